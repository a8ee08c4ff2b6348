// nlmserve C++ client implementation (see nlmserve_client.h): the connection, its retries,
// the model's facts and vocabulary, the cache in front of the server, the batched requests
// and the scoring tables' download. The channels are nlmserve_channel.h's; the rules the
// client applies are their own files' (nlmserve_ngram.cpp, nlmserve_target.cpp,
// nlmserve_tokens.cpp, nlmserve_retry.cpp).
#include "nlmserve_client.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "ngram_cache.h"
#include "nlmserve_channel.h"

namespace nlmserve {
namespace {

namespace pb = ::nlmserve::v1;

thread_local uint64_t tl_round_trips = 0;

bool StartsWith(const std::string &s, const char *prefix) { return s.rfind(prefix, 0) == 0; }

#if !(defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__)
// The wire's packed ids are little-endian (a little-endian host copies its rows as they are).
void PutU32(uint32_t v, std::string *out) {
  char b[4] = {static_cast<char>(v & 0xff), static_cast<char>((v >> 8) & 0xff),
               static_cast<char>((v >> 16) & 0xff), static_cast<char>((v >> 24) & 0xff)};
  out->append(b, 4);
}
#endif

// The calling thread's buffers for ScoreRows and the vector wrappers: they grow to the
// largest batch seen and are reused, so a batch allocates nothing per n-gram.
struct BatchBuffers {
  std::vector<uint32_t> rows;        // canonical rows of the vector wrappers
  std::vector<uint32_t> misses;      // the distinct rows not in the cache, `width` ids each
  std::vector<float> miss_scores;    // their scores
  std::vector<std::pair<std::size_t, uint32_t> > fill;  // (row, its index in `misses`)
  std::vector<uint32_t> seen;        // open addressing over `misses`: index + 1, 0 empty
  std::vector<uint64_t> hashes;      // HashRow of each row of the batch
  std::vector<uint8_t> found;        // 1: the row was in the cache
  std::vector<uint64_t> miss_hashes; // HashRow of each row of `misses`
  NgramCache::Scratch cache_scratch; // the cache's batched lookups and inserts
  std::size_t seen_slots = 0;        // slots of `seen` in use (a power of 2)
  pb::ScoreNgramsRequest request;
  pb::ScoreNgramsResponse response;

  // Empties `seen` for a batch of `rows` rows: at least twice as many slots as rows.
  void ResetSeen(std::size_t rows) {
    std::size_t slots = 16;
    while (slots < 2 * rows) slots *= 2;
    if (seen.size() < slots) seen.resize(slots);
    std::fill(seen.begin(), seen.begin() + slots, 0u);
    seen_slots = slots;
  }
};

BatchBuffers &ThreadBuffers() {
  thread_local BatchBuffers buffers;
  return buffers;
}

}  // namespace

struct Client::Impl {
  std::string target;
  ClientOptions options;
  Endpoint endpoint;
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  std::string tls_name;  // name the servers' certificates are checked against ("" : the target's)
  std::string authorization;  // "Bearer <token>", or empty
  ModelInfo info;
  bool lowercase = false;
  std::vector<std::string> words;
  std::unordered_map<std::string, uint32_t> ids;
  std::unique_ptr<NgramCache> cache;  // made once the model's order is known

  // Client-level counts: cache hits and distinct misses, per batch.
  std::atomic<uint64_t> cache_hits{0};
  std::atomic<uint64_t> cache_misses{0};

  std::mutex conn_mutex;
  std::shared_ptr<Connection> conn;  // guarded by conn_mutex
  uint64_t next_generation = 1;      // guarded by conn_mutex

  std::atomic<uint64_t> round_trips{0};
  std::atomic<uint64_t> failed_calls{0};
  std::atomic<uint64_t> reconnects{0};
  std::atomic<uint64_t> ngrams_sent{0};

  Impl(const std::string &t, const ClientOptions &o)
      : target(t), options(o), endpoint(ParseTarget(t)) {
    credentials = Credentials(options);
    bool tls = !(options.tls_ca.empty() && options.tls_cert.empty() && options.tls_key.empty() &&
                 options.tls_server_name.empty());
    tls_name = options.tls_server_name;
    if (tls && tls_name.empty() && endpoint.replicated && !endpoint.replicas.empty()) {
      // A static list's target names no single host: check the certificates against
      // the host name all replicas share.
      if (endpoint.host_name.empty()) {
        throw ClientError(-1, "replicas on different hosts over TLS need tls_server_name "
                              "(the name in their certificates)");
      }
      tls_name = endpoint.host_name;
    }
    if (!options.token_file.empty()) authorization = "Bearer " + ReadTokenFile(options.token_file);
  }

  std::shared_ptr<Connection> NewConnection() {
    return MakeConnection(endpoint, credentials, tls_name, next_generation++);
  }

  std::shared_ptr<Connection> Current() {
    std::lock_guard<std::mutex> lock(conn_mutex);
    return conn;
  }

  // Replaces the connection that failed (unless another thread already did) and
  // waits until the new channel is ready or the connect timeout passes.
  std::shared_ptr<Connection> Reconnect(const std::shared_ptr<Connection> &failed) {
    std::shared_ptr<Connection> c;
    {
      std::lock_guard<std::mutex> lock(conn_mutex);
      if (!conn || conn == failed) {
        conn = NewConnection();
        reconnects.fetch_add(1, std::memory_order_relaxed);
      }
      c = conn;
    }
    c->channel->WaitForConnected(DeadlineIn(options.connect_timeout_ms));
    return c;
  }

  // Runs an RPC with the per-call deadline, reconnecting and retrying on
  // transient failures. `call` gets the stub and a fresh context.
  template <class F>
  void WithRetries(const std::string &what, F call, int deadline_ms = 0) {
    std::shared_ptr<Connection> c = Current();
    grpc::Status status;
    for (int attempt = 0; attempt <= options.retries; ++attempt) {
      if (attempt > 0) {
        if (endpoint.replicated) {
          // round_robin drops a dead or unhealthy replica from the channel by itself:
          // the retry goes to a survivor on the same channel after a short pause.
          std::this_thread::sleep_for(std::chrono::milliseconds(50 << std::min(attempt - 1, 5)));
        } else {
          c = Reconnect(c);
        }
      }
      grpc::ClientContext ctx;
      ctx.set_deadline(DeadlineIn(std::max(deadline_ms, options.deadline_ms)));
      if (!authorization.empty()) ctx.AddMetadata("authorization", authorization);
      status = call(*c->stub, &ctx);
      if (status.ok()) return;
      failed_calls.fetch_add(1, std::memory_order_relaxed);
      if (!Retryable(status.error_code(), status.error_message())) break;
      if (status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50 << std::min(attempt, 5)));
      }
    }
    throw ClientError(status.error_code(), Describe(what, target, status));
  }

  void Connect() {
    {
      std::lock_guard<std::mutex> lock(conn_mutex);
      conn = NewConnection();
    }
    if (!Current()->channel->WaitForConnected(DeadlineIn(options.connect_timeout_ms))) {
      // Not fatal yet: WithRetries below reconnects and reports the final status.
    }
    pb::ModelInfo mi;
    WithRetries("GetModelInfo", [&](pb::LanguageModel::Stub &stub, grpc::ClientContext *ctx) {
      return stub.GetModelInfo(ctx, pb::GetModelInfoRequest(), &mi);
    });
    if (endpoint.replicated) CheckReplicaModels(mi.model_hash());
    info.order = mi.order();
    info.vocab_size = mi.vocab_size();
    info.bos_id = mi.bos_id();
    info.eos_id = mi.eos_id();
    info.unk_id = mi.unk_id();
    info.model_hash = mi.model_hash();
    info.objective = mi.objective();
    info.device = mi.device();
    info.self_normalized = mi.self_normalized();
    info.lowercase = mi.lowercase();
    info.max_ngrams_per_request = mi.max_ngrams_per_request();
    if (info.order == 0 || info.vocab_size == 0) {
      throw ClientError(-1, "nlmserve server at " + target + " reports order " +
                                std::to_string(info.order) + " and vocabulary size " +
                                std::to_string(info.vocab_size));
    }
    lowercase = options.lowercase || info.lowercase;
    cache.reset(new NgramCache(options.cache_size, options.cache_shards, info.order));
    FetchVocabulary();
  }

  // Requires every reachable replica to serve the model `pinned` (ClientError 9
  // otherwise). A static list asks each address once on its own channel; a resolver name
  // asks the balanced channel four times (round_robin gives each ready replica a turn).
  // Replicas that cannot be reached now are checked by their first answer instead.
  void CheckReplicaModels(const std::string &pinned) {
    std::vector<std::string> hashes;
    if (StartsWith(endpoint.target, "dns:")) {
      for (int i = 0; i < 4; ++i) {
        pb::ModelInfo other;
        WithRetries("GetModelInfo", [&](pb::LanguageModel::Stub &stub, grpc::ClientContext *ctx) {
          return stub.GetModelInfo(ctx, pb::GetModelInfoRequest(), &other);
        });
        hashes.push_back(other.model_hash());
      }
    } else {
      std::string scheme = endpoint.target.substr(0, endpoint.target.find(':') + 1);
      std::istringstream list(endpoint.target.substr(scheme.size()));
      std::string address;
      while (std::getline(list, address, ',')) {
        Endpoint one;
        one.target = scheme + address;
        std::shared_ptr<Connection> c = MakeConnection(one, credentials, tls_name, 0);
        grpc::ClientContext ctx;
        ctx.set_deadline(DeadlineIn(options.connect_timeout_ms));
        if (!authorization.empty()) ctx.AddMetadata("authorization", authorization);
        pb::ModelInfo other;
        if (c->stub->GetModelInfo(&ctx, pb::GetModelInfoRequest(), &other).ok()) {
          hashes.push_back(other.model_hash());
        }
      }
    }
    for (const std::string &h : hashes) {
      if (h != pinned) {
        throw ClientError(9, "replicas of " + target + " serve different models: " + pinned + " and " + h +
                                 " (every replica must serve one model file)");
      }
    }
  }

  void FetchVocabulary() {
    std::vector<std::string> got;
    WithRetries("GetVocabulary", [&](pb::LanguageModel::Stub &stub, grpc::ClientContext *ctx) {
      got.clear();
      got.reserve(info.vocab_size);
      pb::GetVocabularyRequest req;
      std::unique_ptr<grpc::ClientReader<pb::VocabularyChunk> > reader(stub.GetVocabulary(ctx, req));
      pb::VocabularyChunk chunk;
      while (reader->Read(&chunk)) {
        if (chunk.offset() != got.size()) {
          ctx->TryCancel();
          reader->Finish();
          return grpc::Status(grpc::StatusCode::DATA_LOSS,
                              "vocabulary chunk at offset " + std::to_string(chunk.offset()) +
                                  " after " + std::to_string(got.size()) + " words");
        }
        for (const std::string &w : chunk.words()) got.push_back(w);
      }
      return reader->Finish();
    });
    if (got.size() != info.vocab_size) {
      throw ClientError(-1, "nlmserve server at " + target + " sent " + std::to_string(got.size()) +
                                " vocabulary words, model info says " +
                                std::to_string(info.vocab_size));
    }
    words.swap(got);
    ids.reserve(words.size());
    for (uint32_t i = 0; i < words.size(); ++i) ids.emplace(words[i], i);
  }

  std::shared_ptr<const ScoringTables> FetchTables(int deadline_ms) {
    std::vector<float> data;
    pb::ScoringTablesChunk head;
    WithRetries(
        "GetScoringTables",
        [&](pb::LanguageModel::Stub &stub, grpc::ClientContext *ctx) {
          data.clear();
          std::unique_ptr<grpc::ClientReader<pb::ScoringTablesChunk> > reader(
              stub.GetScoringTables(ctx, pb::GetScoringTablesRequest()));
          pb::ScoringTablesChunk chunk;
          bool first = true;
          while (reader->Read(&chunk)) {
            if (first) {
              head = chunk;
              head.clear_data();
              data.reserve(head.total_floats());
              AdviseHugePages(data.data(), data.capacity() * sizeof(float));  // before the floats are written
              first = false;
            }
            const std::string &bytes = chunk.data();
            if (chunk.offset() != data.size() || bytes.size() % sizeof(float) != 0 ||
                data.size() + bytes.size() / sizeof(float) > head.total_floats()) {
              ctx->TryCancel();
              reader->Finish();
              return grpc::Status(grpc::StatusCode::DATA_LOSS, "scoring tables chunk at offset " +
                                                                   std::to_string(chunk.offset()) + " after " +
                                                                   std::to_string(data.size()) + " floats");
            }
            const std::size_t at = data.size();
            data.resize(at + bytes.size() / sizeof(float));
            std::memcpy(data.data() + at, bytes.data(), bytes.size());  // little-endian float32, as x86 and ARM
          }
          return reader->Finish();
        },
        deadline_ms);
    if (head.model_hash() != info.model_hash) {
      throw ClientError(9, "nlmserve server at " + target + " sent the scoring tables of model " + head.model_hash() +
                               ", not of " + info.model_hash + " (reloaded since the client connected?)");
    }
    Activation activation;
    if (!ParseActivation(head.activation(), &activation)) {
      throw ClientError(-1, "nlmserve server at " + target + " sent scoring tables with activation '" +
                                head.activation() + "', which this client does not know");
    }
    if (!head.output().empty() && head.output() != "class" && head.output() != "tree") {
      throw ClientError(-1, "nlmserve server at " + target + " sent scoring tables of a '" + head.output() +
                                "' output, which this client does not know");
    }
    std::shared_ptr<ScoringTables> tables(new ScoringTables());
    ScoringTables::Features features;
    features.order = head.feature_order();
    features.class_table = head.ngram_class_table();
    features.word_table = head.ngram_word_table();
    ScoringTables::Tree tree;
    const bool treed = head.output() == "tree";
    if (treed) {
      tree.nodes = head.tree_nodes();
      tree.codes = head.tree_codes();
      tree.steps = head.tree_steps();
    }
    const std::size_t got = data.size();
    if (head.order() != info.order || head.vocab_size() != info.vocab_size || (treed && tree.nodes == 0) ||
        !tables->Set(head.order(), head.vocab_size(), head.dim(), activation, head.model_hash(), std::move(data),
                     features, tree)) {
      throw ClientError(-1, "nlmserve server at " + target + " sent " + std::to_string(got) +
                                " floats of scoring tables for order " + std::to_string(head.order()) +
                                ", vocabulary " + std::to_string(head.vocab_size()) + ", width " +
                                std::to_string(head.dim()) +
                                (treed ? ", a tree of " + std::to_string(tree.nodes) + " nodes, " +
                                             std::to_string(tree.codes) + " codes and " +
                                             std::to_string(tree.steps) + " steps"
                                       : ", n-gram features of order " + std::to_string(features.order) +
                                             " in tables of " + std::to_string(features.class_table) + " and " +
                                             std::to_string(features.word_table)) +
                                " (model info: order " + std::to_string(info.order) + ", vocabulary " +
                                std::to_string(info.vocab_size) + ")");
    }
    return tables;
  }

  // CanonicalRow for the served model; throws ClientError (code 3) naming `index`.
  void Canonical(const uint32_t *ids, std::size_t n, std::size_t index, uint32_t *out) const {
    NgramError error = nlmserve::CanonicalRow(ids, n, info, out);
    if (error != NgramError::kNone) throw ClientError(3, NgramErrorMessage(error, ids, n, index, info));
  }

  // Sends the `count` rows at `rows` (canonical, `order` ids each) in one request and
  // writes their scores to `out`.
  void Send(const uint32_t *rows, std::size_t count, float *out, BatchBuffers &buffers, BatchCounts *counts) {
    const std::size_t width = info.order;
    pb::ScoreNgramsRequest &req = buffers.request;
    req.Clear();
    req.set_packed_order(info.order);
    req.set_log_base(pb::LOG10);
    req.set_allow_unnormalized(!options.normalized);
    std::string *packed = req.mutable_packed_ids();
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    packed->assign(reinterpret_cast<const char *>(rows), count * width * sizeof(uint32_t));
#else
    packed->reserve(count * width * 4);
    for (std::size_t i = 0; i < count * width; ++i) PutU32(rows[i], packed);
#endif
    pb::ScoreNgramsResponse &resp = buffers.response;
    WithRetries("ScoreNgrams", [&](pb::LanguageModel::Stub &stub, grpc::ClientContext *ctx) {
      resp.Clear();
      return stub.ScoreNgrams(ctx, req, &resp);
    });
    round_trips.fetch_add(1, std::memory_order_relaxed);
    ++tl_round_trips;
    ngrams_sent.fetch_add(count, std::memory_order_relaxed);
    if (counts) {
      ++counts->round_trips;
      counts->ngrams_sent += count;
    }
    if (static_cast<std::size_t>(resp.log_probs_size()) != count) {
      throw ClientError(-1, "nlmserve server at " + target + " returned " +
                                std::to_string(resp.log_probs_size()) + " scores for " +
                                std::to_string(count) + " n-grams");
    }
    if (resp.log_base() == pb::LN) {
      throw ClientError(-1, "nlmserve server at " + target + " answered in LN where LOG10 was asked");
    }
    if (!resp.model_hash().empty() && resp.model_hash() != info.model_hash) {
      if (endpoint.replicated) {
        throw ClientError(9, "replicas of " + target + " serve different models: " + info.model_hash +
                                 " and " + resp.model_hash() + " (every replica must serve one model file)");
      }
      throw ClientError(9, "nlmserve server at " + target + " now serves model " + resp.model_hash() +
                               ", the client was set up for " + info.model_hash +
                               "; restart the client to use the new model");
    }
    std::copy(resp.log_probs().begin(), resp.log_probs().end(), out);
  }

  void ScoreRows(const uint32_t *rows, std::size_t n_rows, std::size_t width, float *out, BatchCounts *counts) {
    if (width != info.order) {
      throw ClientError(3, "rows of " + std::to_string(width) + " ids given; the model's rows have " +
                               std::to_string(info.order));
    }
    // What the server would refuse, refused here with the row's index.
    NgramError error;
    const std::size_t bad = FirstBadRow(rows, n_rows, info, &error);
    if (bad < n_rows) throw ClientError(3, NgramErrorMessage(error, rows + bad * width, width, bad, info));
    BatchBuffers &b = ThreadBuffers();
    b.misses.clear();
    b.miss_hashes.clear();
    b.fill.clear();
    // Each row hashed once (the cache and the de-duplication below use the same hash),
    // then all rows looked up as one batch: the cache prefetches their slots and locks
    // each shard once (NgramCache::GetMany, which leaves the cache as Gets in row order
    // would).
    b.hashes.resize(n_rows);
    for (std::size_t i = 0; i < n_rows; ++i) b.hashes[i] = HashRow(rows + i * width, width);
    b.found.resize(n_rows);
    const uint64_t hits = cache->GetMany(rows, n_rows, out, b.found.data(), b.cache_scratch, b.hashes.data());
    if (hits < n_rows) b.ResetSeen(n_rows - hits);
    // The misses in row order, as before: the request carries them in the same order.
    for (std::size_t i = 0; i < n_rows; ++i) {
      if (b.found[i]) continue;
      const uint32_t *row = rows + i * width;
      // The batch's earlier miss of the same row, or a new one.
      const std::size_t mask = b.seen_slots - 1;
      std::size_t slot = static_cast<std::size_t>(b.hashes[i]) & mask;
      uint32_t m;
      for (;; slot = (slot + 1) & mask) {
        const uint32_t at = b.seen[slot];
        if (at == 0) {
          m = static_cast<uint32_t>(b.misses.size() / width);
          b.misses.insert(b.misses.end(), row, row + width);
          b.miss_hashes.push_back(b.hashes[i]);
          b.seen[slot] = m + 1;
          break;
        }
        if (std::equal(row, row + width, b.misses.begin() + (at - 1) * width)) {
          m = at - 1;
          break;
        }
      }
      b.fill.push_back(std::make_pair(i, m));
    }
    const std::size_t distinct = b.misses.size() / width;
    cache_hits.fetch_add(hits, std::memory_order_relaxed);
    cache_misses.fetch_add(distinct, std::memory_order_relaxed);
    if (counts) {
      counts->cache_hits += hits;
      counts->cache_misses += distinct;
    }
    if (distinct == 0) return;
    b.miss_scores.resize(distinct);
    const std::size_t limit = info.max_ngrams_per_request > 0
                                  ? static_cast<std::size_t>(info.max_ngrams_per_request)
                                  : distinct;
    for (std::size_t begin = 0; begin < distinct; begin += limit) {
      const std::size_t count = std::min(distinct - begin, limit);
      Send(b.misses.data() + begin * width, count, b.miss_scores.data() + begin, b, counts);
    }
    cache->PutMany(b.misses.data(), distinct, b.miss_scores.data(), b.cache_scratch, b.miss_hashes.data());
    for (std::size_t f = 0; f < b.fill.size(); ++f) out[b.fill[f].first] = b.miss_scores[b.fill[f].second];
  }

  std::vector<float> ScoreBatch(const std::vector<std::vector<uint32_t> > &ngrams) {
    const std::size_t width = info.order;
    std::vector<uint32_t> &rows = ThreadBuffers().rows;  // ScoreRows uses the other buffers
    rows.resize(ngrams.size() * width);
    for (std::size_t i = 0; i < ngrams.size(); ++i) {
      Canonical(ngrams[i].data(), ngrams[i].size(), i, rows.data() + i * width);
    }
    std::vector<float> result(ngrams.size(), 0.0f);
    ScoreRows(rows.data(), ngrams.size(), width, result.data(), nullptr);
    return result;
  }

  uint32_t WordId(const std::string &word) const {
    auto it = ids.find(lowercase ? Lowercase(word) : word);
    return it == ids.end() ? info.unk_id : it->second;
  }
};

Client::Client(const std::string &target, const ClientOptions &options)
    : impl_(new Impl(target, options)) {
  impl_->Connect();
}

Client::~Client() = default;

const ModelInfo &Client::info() const { return impl_->info; }
const ClientOptions &Client::options() const { return impl_->options; }
const std::string &Client::target() const { return impl_->target; }

uint32_t Client::WordId(const std::string &word) const { return impl_->WordId(word); }

void Client::CanonicalRow(const uint32_t *ids, std::size_t n, uint32_t *out, std::size_t index) const {
  impl_->Canonical(ids, n, index, out);
}

std::vector<uint32_t> Client::CanonicalRow(const std::vector<uint32_t> &ngram, std::size_t index) const {
  std::vector<uint32_t> row(impl_->info.order);
  impl_->Canonical(ngram.data(), ngram.size(), index, row.data());
  return row;
}

bool Client::Known(const std::string &word) const {
  return impl_->ids.count(impl_->lowercase ? Lowercase(word) : word) > 0;
}

std::string Client::Word(uint32_t id) const {
  return id < impl_->words.size() ? impl_->words[id] : std::string();
}

void Client::ScoreRows(const uint32_t *rows, std::size_t n_rows, std::size_t width, float *out,
                       BatchCounts *counts) {
  impl_->ScoreRows(rows, n_rows, width, out, counts);
}

std::vector<float> Client::ScoreBatch(const std::vector<std::vector<uint32_t> > &ngrams) {
  return impl_->ScoreBatch(ngrams);
}

std::vector<float> Client::ScoreStrings(const std::vector<std::vector<std::string> > &ngrams) {
  const std::size_t width = impl_->info.order;
  std::vector<uint32_t> &rows = ThreadBuffers().rows;
  rows.resize(ngrams.size() * width);
  std::vector<uint32_t> ids;
  for (std::size_t i = 0; i < ngrams.size(); ++i) {
    ids.clear();
    for (const std::string &w : ngrams[i]) ids.push_back(impl_->WordId(w));
    impl_->Canonical(ids.data(), ids.size(), i, rows.data() + i * width);
  }
  std::vector<float> result(ngrams.size(), 0.0f);
  impl_->ScoreRows(rows.data(), ngrams.size(), width, result.data(), nullptr);
  return result;
}

float Client::Score(const std::vector<uint32_t> &ngram) {
  std::vector<uint32_t> &row = ThreadBuffers().rows;
  row.resize(impl_->info.order);
  impl_->Canonical(ngram.data(), ngram.size(), 0, row.data());
  float score = 0.0f;
  impl_->ScoreRows(row.data(), 1, row.size(), &score, nullptr);
  return score;
}

ClientStats Client::stats() const {
  ClientStats s;
  s.cache_hits = impl_->cache_hits.load();
  s.cache_misses = impl_->cache_misses.load();
  s.round_trips = impl_->round_trips.load();
  s.failed_calls = impl_->failed_calls.load();
  s.reconnects = impl_->reconnects.load();
  s.ngrams_sent = impl_->ngrams_sent.load();
  return s;
}

void Client::ResetStats() {
  impl_->cache->ResetCounters();
  impl_->cache_hits = 0;
  impl_->cache_misses = 0;
  impl_->round_trips = 0;
  impl_->failed_calls = 0;
  impl_->reconnects = 0;
  impl_->ngrams_sent = 0;
}

void Client::ClearCache() { impl_->cache->Clear(); }
std::size_t Client::CacheEntries() const { return impl_->cache->Size(); }
std::shared_ptr<const ScoringTables> Client::GetScoringTables(int deadline_ms) {
  return impl_->FetchTables(deadline_ms);
}

uint64_t Client::ThreadRoundTrips() { return tl_round_trips; }

}  // namespace nlmserve
