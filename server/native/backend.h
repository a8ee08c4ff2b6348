// What the front end asks the backend's gRPC port itself, apart from the calls it relays:
// the model info at start (FetchInfo: order, vocabulary ids, batch limit, model hash),
// waiting for the backend to come up, and whether the backend's own health service
// reports the LanguageModel service SERVING (BackendServing, the front end's health).
#ifndef NLMSERVE_FRONTEND_BACKEND_H
#define NLMSERVE_FRONTEND_BACKEND_H

#include <string>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include "nlmserve/v1/lm.grpc.pb.h"

namespace nlmserve_frontend {

// The backend's model info, waiting up to `timeout_s` for it to come up; false with the
// last status when it did not answer or refused.
bool FetchInfo(nlmserve::v1::LanguageModel::Stub *stub, long timeout_s, const std::string &token,
               nlmserve::v1::ModelInfo *info, grpc::Status *last);

// Whether the backend's own health service reports the LanguageModel service SERVING.
bool BackendServing(grpc::GenericStub *stub);

}  // namespace nlmserve_frontend

#endif  // NLMSERVE_FRONTEND_BACKEND_H
