// The front end's one gRPC service (CallService): every method it serves, on gRPC's
// generic callback service, each call made the kind its method is (ScoreCall, RelayCall,
// HealthCall; an unknown method ended at once) with what calls consult: the guards, the
// health state, the batcher, the backend's channel and the limits.
#ifndef NLMSERVE_FRONTEND_SERVICE_H
#define NLMSERVE_FRONTEND_SERVICE_H

#include <memory>
#include <string>
#include <utility>

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include "call.h"
#include "guards.h"
#include "health.h"
#include "health_call.h"
#include "nlmserve/v1/lm.grpc.pb.h"
#include "relay_call.h"
#include "score_call.h"

namespace nlmserve_frontend {

// Every method of the front end, on gRPC's generic callback service.
class CallService final : public grpc::CallbackGenericService {
 public:
  CallService(Guards *guards, HealthState *health, ScoreQueue *queue, std::shared_ptr<grpc::Channel> backend,
              const CallLimits &limits)
      : guards_(guards), health_(health), queue_(queue), backend_(std::move(backend)), limits_(limits) {}

  grpc::ServerGenericBidiReactor *CreateReactor(grpc::GenericCallbackServerContext *ctx) override {
    const Method *method = Find(ctx->method());
    std::shared_ptr<Call> call;
    if (method != nullptr && method->kind == Kind::kScore) {
      call = std::make_shared<ScoreCall>(this, ctx, method);
    } else if (method != nullptr && (method->kind == Kind::kHealthCheck || method->kind == Kind::kHealthWatch)) {
      call = std::make_shared<HealthCall>(this, ctx, method);
    } else {
      call = std::make_shared<RelayCall>(this, ctx, method);  // or, for an unknown method, ended at once
    }
    call->Begin(call);
    return call.get();
  }

  Guards *guards() { return guards_; }
  HealthState *health() { return health_; }
  ScoreQueue *queue() { return queue_; }
  grpc::GenericStub *stub() { return &stub_; }
  const CallLimits &limits() const { return limits_; }

 private:
  static const Method *Find(const std::string &path) {
    static const Method kMethods[] = {
        {"/nlmserve.v1.LanguageModel/ScoreNgrams", Kind::kScore, nullptr, 0},
        {"/nlmserve.v1.LanguageModel/ScoreSentences", Kind::kRelay, Parses<nlmserve::v1::ScoreSentencesRequest>, 0},
        {"/nlmserve.v1.LanguageModel/GetModelInfo", Kind::kRelay, Parses<nlmserve::v1::GetModelInfoRequest>, 0},
        {"/nlmserve.v1.LanguageModel/GetVocabulary", Kind::kRelay, Parses<nlmserve::v1::GetVocabularyRequest>, 0},
        {"/nlmserve.v1.LanguageModel/GetScoringTables", Kind::kRelay,
         Parses<nlmserve::v1::GetScoringTablesRequest>, 0},
        // A reload reads and checks a model file: the caller's deadline, not the backend timeout.
        {"/nlmserve.v1.Admin/ReloadModel", Kind::kRelay, Parses<nlmserve::v1::ReloadModelRequest>,
         24L * 3600 * 1000},
        {"/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", Kind::kRelayStream, nullptr, 0},
        {"/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", Kind::kRelayStream, nullptr, 0},
        {"/grpc.health.v1.Health/Check", Kind::kHealthCheck, nullptr, 0},
        {"/grpc.health.v1.Health/Watch", Kind::kHealthWatch, nullptr, 0},
    };
    for (const Method &m : kMethods) {
      if (path == m.path) return &m;
    }
    return nullptr;
  }

  Guards *guards_;
  HealthState *health_;
  ScoreQueue *queue_;
  std::shared_ptr<grpc::Channel> backend_;
  grpc::GenericStub stub_{backend_};
  const CallLimits limits_;
};

}  // namespace nlmserve_frontend

#endif  // NLMSERVE_FRONTEND_SERVICE_H
