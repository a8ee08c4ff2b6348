// A bounded, thread-safe map from canonical n-gram rows (uint32 ids) to scores.
//
// Every key is one row of `width` ids (the model's order), stored inline next to its
// score in one flat array per shard: no allocation on Get or Put, no string keys. A key
// lives in the window of kWindow slots that starts at its home slot (open addressing
// with a bounded probe); when that window is full, Put replaces its least recently used
// entry. Each shard has its own mutex, so threads that look up different n-grams rarely
// wait for each other. A score of any value (0.0 included) is a hit: presence is decided
// by the slot's stamp, never by the value.
#ifndef NLMSERVE_NGRAM_CACHE_H
#define NLMSERVE_NGRAM_CACHE_H

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

namespace nlmserve {

// A hash of the row ids[0, width): two ids per 64-bit multiply, then MurmurHash3's
// finaliser. Shared by the cache and the client's de-duplication of a batch.
inline uint64_t HashRow(const uint32_t *ids, std::size_t width) {
  const uint64_t k = 0x9e3779b97f4a7c15ULL;
  uint64_t h = k * (width + 1);
  std::size_t i = 0;
  for (; i + 2 <= width; i += 2) {
    h = (h ^ (ids[i] | static_cast<uint64_t>(ids[i + 1]) << 32)) * k;
    h ^= h >> 32;
  }
  if (i < width) {
    h = (h ^ ids[i]) * k;
    h ^= h >> 32;
  }
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdULL;
  h ^= h >> 33;
  return h;
}

// x * n / 2^32: a value of x in [0, 2^32) mapped onto [0, n) without a division.
inline std::size_t ScaleToRange(uint32_t x, std::size_t n) {
  return static_cast<std::size_t>((static_cast<uint64_t>(x) * n) >> 32);
}

class NgramCache {
 public:
  // Slots searched for a key, and among which Put evicts.
  static const std::size_t kWindow = 8;

  // capacity: total entries, split over the shards (as evenly as integers allow);
  // capacity 0 (or width 0) disables the cache: every lookup misses, inserts are dropped.
  NgramCache(std::size_t capacity, std::size_t shards, std::size_t width)
      : width_(width), stride_(width + 2), capacity_(width == 0 ? 0 : capacity) {
    if (shards == 0) shards = 1;
    if (capacity_ > 0 && shards > capacity_) shards = capacity_;
    for (std::size_t i = 0; i < shards; ++i) {
      std::size_t slots = capacity_ / shards + (i < capacity_ % shards ? 1 : 0);
      shards_.emplace_back(new Shard(slots, stride_));
    }
  }

  // Looks the row up; on a hit stores its score, marks it used, returns true.
  bool Get(const uint32_t *row, float *score) {
    const uint64_t h = HashRow(row, width_);
    Shard &s = ShardOf(h);
    std::lock_guard<std::mutex> lock(s.mutex);
    uint32_t *e = s.Find(row, Home(s, h), width_, stride_, nullptr);
    if (e == nullptr) {
      ++s.misses;
      return false;
    }
    e[0] = s.Tick();
    std::memcpy(score, &e[1], sizeof(float));
    ++s.hits;
    return true;
  }

  // Inserts or refreshes a row; when its window is full, replaces the window's least
  // recently used entry.
  void Put(const uint32_t *row, float score) {
    const uint64_t h = HashRow(row, width_);
    Shard &s = ShardOf(h);
    std::lock_guard<std::mutex> lock(s.mutex);
    s.Insert(row, Home(s, h), width_, stride_, score);
  }

  // A caller's reusable buffers for GetMany and PutMany (one per thread): they grow to
  // the largest batch and are kept, so a batch allocates nothing.
  struct Scratch {
    std::vector<uint64_t> hashes;   // HashRow of each row, when the caller gives none
    std::vector<uint32_t> order;    // row indices grouped by shard, each group in row order
    std::vector<uint32_t> starts;   // group s is order[starts[s], starts[s + 1])
    std::vector<uint32_t> pending;  // shards whose group is still to do
  };

  // Get of rows i = 0..n-1 (row i at rows + i * width) as one batch: found[i] = 1 and
  // scores[i] set on a hit, found[i] = 0 on a miss; returns the hits. `hashes` (n values
  // of HashRow(row, width)), when given, saves hashing again. The results, the counters
  // and the state the cache is left in are those of Get(row 0), Get(row 1), ... in turn:
  // each shard sees its rows in row order (duplicates included), and shards share nothing.
  // What changes is the memory traffic: every row's window is prefetched a few rows
  // before it is probed (the windows lie at random in a table much larger than the
  // processor's caches), and each shard is locked once per batch instead of once per row.
  std::size_t GetMany(const uint32_t *rows, std::size_t n, float *scores, uint8_t *found, Scratch &scratch,
                      const uint64_t *hashes = nullptr) {
    std::size_t hits = 0;
    ForEachByShard(rows, n, hashes, scratch, [&](Shard &s, std::size_t i, uint64_t h) {
      uint32_t *e = s.Find(rows + i * width_, Home(s, h), width_, stride_, nullptr);
      if (e == nullptr) {
        ++s.misses;
        found[i] = 0;
        return;
      }
      e[0] = s.Tick();
      std::memcpy(&scores[i], &e[1], sizeof(float));
      ++s.hits;
      found[i] = 1;
      ++hits;
    });
    return hits;
  }

  // Put of rows i = 0..n-1 with scores[i], as one batch: the same state as Put(row 0),
  // Put(row 1), ... in turn, with GetMany's prefetching and locking.
  void PutMany(const uint32_t *rows, std::size_t n, const float *scores, Scratch &scratch,
               const uint64_t *hashes = nullptr) {
    ForEachByShard(rows, n, hashes, scratch,
                   [&](Shard &s, std::size_t i, uint64_t h) { s.Insert(rows + i * width_, Home(s, h), width_, stride_, scores[i]); });
  }

  void Clear() {
    for (std::size_t i = 0; i < shards_.size(); ++i) {
      Shard &s = *shards_[i];
      std::lock_guard<std::mutex> lock(s.mutex);
      s.Reset();
    }
  }

  // Entries held (at most the capacity).
  std::size_t Size() const {
    std::size_t n = 0;
    for (std::size_t i = 0; i < shards_.size(); ++i) {
      std::lock_guard<std::mutex> lock(shards_[i]->mutex);
      n += shards_[i]->size;
    }
    return n;
  }

  uint64_t hits() const { return Sum(&Shard::hits); }
  uint64_t misses() const { return Sum(&Shard::misses); }
  void ResetCounters() {
    for (std::size_t i = 0; i < shards_.size(); ++i) {
      std::lock_guard<std::mutex> lock(shards_[i]->mutex);
      shards_[i]->hits = 0;
      shards_[i]->misses = 0;
    }
  }
  std::size_t shard_count() const { return shards_.size(); }
  std::size_t capacity() const { return capacity_; }
  std::size_t width() const { return width_; }

  // The shard of a row and the first slot of its window there (for tests that need
  // rows whose windows collide).
  std::pair<std::size_t, std::size_t> Place(const uint32_t *row) const {
    const uint64_t h = HashRow(row, width_);
    const std::size_t shard = ScaleToRange(static_cast<uint32_t>(h >> 32), shards_.size());
    return std::make_pair(shard, Home(*shards_[shard], h));
  }

 private:
  struct FreeDeleter {
    void operator()(uint32_t *p) const { std::free(p); }
  };

  // A slot is `stride` words: the stamp of its last use (0: empty), the score's bits,
  // then the row's ids.
  struct Shard {
    Shard(std::size_t n, std::size_t stride_words) : slots(n), stride(stride_words) { Reset(); }

    // Zeroed memory from calloc: empty slots, and pages the system maps only when used.
    void Reset() {
      base.store(nullptr, std::memory_order_relaxed);
      data.reset();
      if (slots > 0) {
        data.reset(static_cast<uint32_t *>(std::calloc(slots * stride, sizeof(uint32_t))));
        if (!data) throw std::bad_alloc();
      }
      base.store(data.get(), std::memory_order_relaxed);
      size = 0;
      clock = 0;
    }

    // Asks the processor to load the window at `home` (every cache line of it) without
    // waiting for it. Needs no lock: `base` is read atomically, and a prefetch of memory
    // that a concurrent Clear has just freed is harmless (a prefetch never faults).
    void Prefetch(std::size_t home) const {
      const uint32_t *p = base.load(std::memory_order_relaxed);
      if (p == nullptr) return;
      const char *from = reinterpret_cast<const char *>(p + home * stride);
      const std::size_t window = slots < kWindow ? slots : kWindow;
      // A window that wraps past the last slot is rare: its tail is left to the probe.
      const std::size_t in_table = (slots - home < window ? slots - home : window) * stride * sizeof(uint32_t);
      for (std::size_t b = 0; b < in_table; b += 64) __builtin_prefetch(from + b, 1, 3);
      __builtin_prefetch(from + in_table - 1, 1, 3);
    }

    // Put's work once the shard is locked.
    void Insert(const uint32_t *row, std::size_t home, std::size_t width, std::size_t stride_words, float score) {
      if (slots == 0) return;
      uint32_t *victim = nullptr;
      uint32_t *e = Find(row, home, width, stride_words, &victim);
      if (e == nullptr) {
        e = victim;
        if (e[0] == 0) ++size;
        std::memcpy(&e[2], row, width * sizeof(uint32_t));
      }
      e[0] = Tick();
      std::memcpy(&e[1], &score, sizeof(float));
    }

    uint32_t Tick() {
      if (++clock == 0) clock = 1;  // 0 marks an empty slot
      return clock;
    }

    // Ids compared newest first: rows of one context differ in the predicted word.
    static bool SameRow(const uint32_t *a, const uint32_t *b, std::size_t width) {
      for (std::size_t i = width; i-- > 0;) {
        if (a[i] != b[i]) return false;
      }
      return true;
    }

    // The slot holding `row` in the window at `home`, or nullptr. With `victim`, also
    // the slot a new row would take: the first empty one, else the least recently used.
    uint32_t *Find(const uint32_t *row, std::size_t home, std::size_t width, std::size_t stride_words,
                   uint32_t **victim) {
      if (slots == 0) return nullptr;
      const std::size_t window = slots < kWindow ? slots : kWindow;
      uint32_t oldest_age = 0;
      std::size_t i = home;
      for (std::size_t j = 0; j < window; ++j, ++i) {
        if (i == slots) i = 0;
        uint32_t *e = data.get() + i * stride_words;
        if (e[0] == 0) {
          // Slots are never emptied one by one, so no key of this window lies beyond.
          if (victim) *victim = e;
          return nullptr;
        }
        if (SameRow(&e[2], row, width)) return e;
        const uint32_t age = clock - e[0];
        if (victim && (j == 0 || age > oldest_age)) {
          oldest_age = age;
          *victim = e;
        }
      }
      return nullptr;
    }

    mutable std::mutex mutex;
    const std::size_t slots;
    const std::size_t stride;
    std::unique_ptr<uint32_t, FreeDeleter> data;
    std::atomic<const uint32_t *> base{nullptr};  // data.get(), for Prefetch without the lock
    std::size_t size = 0;
    uint32_t clock = 0;
    uint64_t hits = 0;
    uint64_t misses = 0;
    char pad[64];  // keeps the next shard's lock off this one's cache line
  };

  std::size_t ShardIndex(uint64_t h) const { return ScaleToRange(static_cast<uint32_t>(h >> 32), shards_.size()); }
  Shard &ShardOf(uint64_t h) { return *shards_[ShardIndex(h)]; }

  // Rows whose windows are prefetched ahead of the one probed. A probe that misses the
  // processor's caches waits for memory (~100 ns) while the work of a row is a few tens
  // of ns: a handful of rows in flight hides most of the wait without flooding the
  // processor's outstanding-miss buffers (a window is up to five cache lines).
  static const std::size_t kPrefetchAhead = 4;

  // Calls op(shard, i, hash) for the rows i = 0..n-1 with the row's shard locked: the
  // rows grouped by shard (a stable counting sort, so each shard gets its rows in row
  // order), each group under one lock, every row's window prefetched kPrefetchAhead rows
  // before it is probed. A shard another thread holds is passed over and done after the
  // free ones (so that two threads sweeping the shards do not queue behind each other);
  // when only held shards are left, the next one is waited for.
  template <class Op>
  void ForEachByShard(const uint32_t *rows, std::size_t n, const uint64_t *hashes, Scratch &sc, Op op) {
    if (n == 0) return;
    if (hashes == nullptr) {
      sc.hashes.resize(n);
      for (std::size_t i = 0; i < n; ++i) sc.hashes[i] = HashRow(rows + i * width_, width_);
      hashes = sc.hashes.data();
    }
    const std::size_t nshards = shards_.size();
    sc.starts.assign(nshards + 1, 0);
    for (std::size_t i = 0; i < n; ++i) ++sc.starts[ShardIndex(hashes[i]) + 1];
    for (std::size_t s = 0; s < nshards; ++s) sc.starts[s + 1] += sc.starts[s];
    sc.order.resize(n);
    sc.pending.clear();
    for (std::size_t s = 0; s < nshards; ++s) {
      if (sc.starts[s + 1] > sc.starts[s]) sc.pending.push_back(static_cast<uint32_t>(s));
    }
    // starts[s] is advanced while placing the rows, then equals starts[s + 1]: rebuilt below.
    for (std::size_t i = 0; i < n; ++i) sc.order[sc.starts[ShardIndex(hashes[i])]++] = static_cast<uint32_t>(i);
    for (std::size_t s = nshards; s > 0; --s) sc.starts[s] = sc.starts[s - 1];
    sc.starts[0] = 0;

    const uint32_t *order = sc.order.data();
    const std::size_t ahead = n < kPrefetchAhead ? n : kPrefetchAhead;
    for (std::size_t k = 0; k < ahead; ++k) PrefetchRow(hashes[order[k]]);
    std::size_t done = 0;  // pending[0, done) are finished
    std::size_t next = 0;  // the position in `order` after the last group done
    while (done < sc.pending.size()) {
      // The first free shard among those left, else the first left (waited for).
      std::size_t pick = done;
      bool locked = false;
      for (std::size_t p = done; p < sc.pending.size(); ++p) {
        if (shards_[sc.pending[p]]->mutex.try_lock()) {
          pick = p;
          locked = true;
          break;
        }
      }
      if (pick != done) std::swap(sc.pending[pick], sc.pending[done]);
      const std::size_t s = sc.pending[done++];
      Shard &shard = *shards_[s];
      if (!locked) shard.mutex.lock();
      std::lock_guard<std::mutex> guard(shard.mutex, std::adopt_lock);
      const std::size_t begin = sc.starts[s], end = sc.starts[s + 1];
      if (begin != next) {
        // A group out of turn (one passed over before): its first rows were not prefetched.
        for (std::size_t k = begin; k < end && k < begin + ahead; ++k) PrefetchRow(hashes[order[k]]);
      }
      for (std::size_t k = begin; k < end; ++k) {
        // Ahead in grouped order: the last rows of a group prefetch the next group's first.
        if (k + ahead < n) PrefetchRow(hashes[order[k + ahead]]);
        const std::size_t i = order[k];
        op(shard, i, hashes[i]);
      }
      next = end;
    }
  }

  void PrefetchRow(uint64_t h) const {
    const Shard &s = *shards_[ShardIndex(h)];
    if (s.slots > 0) s.Prefetch(Home(s, h));
  }
  static std::size_t Home(const Shard &s, uint64_t h) { return ScaleToRange(static_cast<uint32_t>(h), s.slots); }

  uint64_t Sum(uint64_t Shard::*field) const {
    uint64_t n = 0;
    for (std::size_t i = 0; i < shards_.size(); ++i) {
      std::lock_guard<std::mutex> lock(shards_[i]->mutex);
      n += (*shards_[i]).*field;
    }
    return n;
  }

  const std::size_t width_;
  const std::size_t stride_;
  const std::size_t capacity_;
  std::vector<std::unique_ptr<Shard> > shards_;
};

}  // namespace nlmserve

#endif  // NLMSERVE_NGRAM_CACHE_H
