// A thread-safe, sharded least-recently-used map from n-gram keys to scores.
//
// Each shard has its own mutex, list and hash map, so threads that look up
// different n-grams rarely wait for each other. A score of any value (0.0
// included) is a hit: presence is decided by the map, never by the value.
#ifndef NLMSERVE_LRU_CACHE_H
#define NLMSERVE_LRU_CACHE_H

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace nlmserve {

class ShardedLruCache {
 public:
  // capacity: total entries (split evenly over the shards, at least 1 each);
  // capacity 0 disables the cache (every lookup misses, inserts are dropped).
  ShardedLruCache(std::size_t capacity, std::size_t shards)
      : enabled_(capacity > 0) {
    if (shards == 0) shards = 1;
    if (capacity > 0 && shards > capacity) shards = capacity;
    std::size_t per_shard = capacity == 0 ? 0 : (capacity + shards - 1) / shards;
    for (std::size_t i = 0; i < shards; ++i) {
      shards_.emplace_back(new Shard(per_shard));
    }
  }

  // Looks the key up; on a hit stores the score, marks it most recent, returns true.
  bool Get(const std::string &key, float *score) {
    if (!enabled_) {
      misses_.fetch_add(1, std::memory_order_relaxed);
      return false;
    }
    Shard &s = ShardFor(key);
    std::lock_guard<std::mutex> lock(s.mutex);
    auto it = s.map.find(key);
    if (it == s.map.end()) {
      misses_.fetch_add(1, std::memory_order_relaxed);
      return false;
    }
    s.order.splice(s.order.begin(), s.order, it->second);
    *score = it->second->second;
    hits_.fetch_add(1, std::memory_order_relaxed);
    return true;
  }

  // Inserts or refreshes a key; evicts the least recently used entry when full.
  void Put(const std::string &key, float score) {
    if (!enabled_) return;
    Shard &s = ShardFor(key);
    std::lock_guard<std::mutex> lock(s.mutex);
    auto it = s.map.find(key);
    if (it != s.map.end()) {
      it->second->second = score;
      s.order.splice(s.order.begin(), s.order, it->second);
      return;
    }
    s.order.emplace_front(key, score);
    s.map.emplace(key, s.order.begin());
    if (s.map.size() > s.capacity) {
      s.map.erase(s.order.back().first);
      s.order.pop_back();
    }
  }

  void Clear() {
    for (auto &s : shards_) {
      std::lock_guard<std::mutex> lock(s->mutex);
      s->map.clear();
      s->order.clear();
    }
  }

  std::size_t Size() const {
    std::size_t n = 0;
    for (auto &s : shards_) {
      std::lock_guard<std::mutex> lock(s->mutex);
      n += s->map.size();
    }
    return n;
  }

  uint64_t hits() const { return hits_.load(std::memory_order_relaxed); }
  uint64_t misses() const { return misses_.load(std::memory_order_relaxed); }
  void ResetCounters() {
    hits_.store(0, std::memory_order_relaxed);
    misses_.store(0, std::memory_order_relaxed);
  }
  std::size_t shard_count() const { return shards_.size(); }

 private:
  typedef std::list<std::pair<std::string, float> > Order;
  struct Shard {
    explicit Shard(std::size_t cap) : capacity(cap) {}
    mutable std::mutex mutex;
    std::size_t capacity;
    Order order;  // most recent first
    std::unordered_map<std::string, Order::iterator> map;
  };

  Shard &ShardFor(const std::string &key) {
    // FNV-1a over the key bytes, independent of the map's own hash.
    uint64_t h = 1469598103934665603ULL;
    for (unsigned char c : key) {
      h ^= c;
      h *= 1099511628211ULL;
    }
    return *shards_[h % shards_.size()];
  }

  bool enabled_;
  std::vector<std::unique_ptr<Shard> > shards_;
  std::atomic<uint64_t> hits_{0};
  std::atomic<uint64_t> misses_{0};
};

}  // namespace nlmserve

#endif  // NLMSERVE_LRU_CACHE_H
