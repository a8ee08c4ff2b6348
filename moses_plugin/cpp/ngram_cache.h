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
    if (s.slots == 0) return;
    uint32_t *victim = nullptr;
    uint32_t *e = s.Find(row, Home(s, h), width_, stride_, &victim);
    if (e == nullptr) {
      e = victim;
      if (e[0] == 0) ++s.size;
      std::memcpy(&e[2], row, width_ * sizeof(uint32_t));
    }
    e[0] = s.Tick();
    std::memcpy(&e[1], &score, sizeof(float));
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
      data.reset();
      if (slots > 0) {
        data.reset(static_cast<uint32_t *>(std::calloc(slots * stride, sizeof(uint32_t))));
        if (!data) throw std::bad_alloc();
      }
      size = 0;
      clock = 0;
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
    std::size_t size = 0;
    uint32_t clock = 0;
    uint64_t hits = 0;
    uint64_t misses = 0;
    char pad[64];  // keeps the next shard's lock off this one's cache line
  };

  Shard &ShardOf(uint64_t h) { return *shards_[ScaleToRange(static_cast<uint32_t>(h >> 32), shards_.size())]; }
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
