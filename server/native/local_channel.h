// The front end's private channel to the model server (server/local.py): one Unix socket
// connection per sender thread of the batcher, one merged packed batch out as an NLQ2
// frame (local_frames.h) and its NLR2 answer back, turned into the ScoreNgrams response
// the gRPC servicer would give and each client request's own status. A connection that
// fails, times out or carries a frame that breaks the rule is closed (the batch gets
// UNAVAILABLE or DEADLINE_EXCEEDED); the next batch connects again.
#ifndef NLMSERVE_FRONTEND_LOCAL_CHANNEL_H
#define NLMSERVE_FRONTEND_LOCAL_CHANNEL_H

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "nlmserve/v1/lm.grpc.pb.h"

namespace nlmserve_frontend {

class LocalChannel {
 public:
  LocalChannel(std::string path, long timeout_ms) : path_(std::move(path)), timeout_ms_(timeout_ms) {}
  ~LocalChannel() { Close(); }
  LocalChannel(const LocalChannel &) = delete;
  LocalChannel &operator=(const LocalChannel &) = delete;

  // Sends the merged packed request made of `parts` (each client request's rows and its
  // own packed order, in row order) and fills `res` (scores, OOV flags from `unk_id`, log
  // base, normalisation, model hash) as the gRPC servicer would. Returns the batch's
  // status (the server's, or the channel's failure); when it is OK, `part_status` holds
  // each part's own status (a failed part's rows hold no score).
  grpc::Status Call(const nlmserve::v1::ScoreNgramsRequest &req,
                    const std::vector<std::pair<uint32_t, uint32_t> > &parts, const std::string &authorization,
                    uint32_t unk_id, nlmserve::v1::ScoreNgramsResponse *res, std::vector<grpc::Status> *part_status);

 private:
  bool Connect(std::string *error);
  void Close();
  // The connection is unusable (server gone, timeout, garbage): drop it; the next call reconnects.
  grpc::Status Broken(const std::string &what);
  bool WriteAll(const char *p, std::size_t n);
  bool ReadAll(char *p, std::size_t n);

  const std::string path_;
  const long timeout_ms_;
  int fd_ = -1;
  uint32_t next_id_ = 1;
};

}  // namespace nlmserve_frontend

#endif  // NLMSERVE_FRONTEND_LOCAL_CHANNEL_H
