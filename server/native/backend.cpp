// FetchInfo and BackendServing (backend.h).
#include "backend.h"

#include <algorithm>
#include <chrono>
#include <future>
#include <thread>

#include "health.h"

namespace nlmserve_frontend {

using nlmserve::v1::GetModelInfoRequest;
using nlmserve::v1::LanguageModel;
using nlmserve::v1::ModelInfo;

// The backend's model info, waiting up to the connect timeout for it to come up.
bool FetchInfo(LanguageModel::Stub *stub, long timeout_s, const std::string &token, ModelInfo *info,
               grpc::Status *last) {
  auto until = std::chrono::system_clock::now() + std::chrono::seconds(timeout_s);
  while (std::chrono::system_clock::now() < until) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::min(until, std::chrono::system_clock::now() + std::chrono::seconds(5)));
    ctx.set_wait_for_ready(true);
    if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
    *last = stub->GetModelInfo(&ctx, GetModelInfoRequest(), info);
    if (last->ok()) return true;
    if (last->error_code() != grpc::StatusCode::UNAVAILABLE &&
        last->error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  return false;
}

// Whether the backend's own health service reports the LanguageModel service SERVING. The
// backend never limits its health service (server/gate.py), so no client, however many
// calls it holds, can make this probe fail.
bool BackendServing(grpc::GenericStub *stub) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  grpc::ByteBuffer request = HealthRequest(kServiceName), response;
  std::promise<grpc::Status> done;
  stub->UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                  [&done](grpc::Status status) { done.set_value(status); });
  return done.get_future().get().ok() && ParseHealthResponse(&response) == kServing;
}

}  // namespace nlmserve_frontend
