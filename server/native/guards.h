// The native front end's guards, as every call consults them (Guards, owned by main):
// tokens (tokens.h), slots (slots.h), calls waiting for their message (waiting.h), refusal
// counts (refusals.h), the connection registry (connections.h) and whether the front end
// is stopping. The memory guard (memory.h) and
// the status of each ending (endings.h) stand apart: the first watches the process, the
// second is the status table.
#ifndef NLMSERVE_FRONTEND_GUARDS_H
#define NLMSERVE_FRONTEND_GUARDS_H

#include <atomic>

#include "connections.h"
#include "refusals.h"
#include "slots.h"
#include "tokens.h"
#include "waiting.h"

namespace nlmserve_frontend {

const char *const kRpcFlags[3] = {"--max-concurrent-rpcs", "--max-rpcs-per-connection", "--max-rpcs-per-client"};
const char *const kWatchFlags[3] = {"--max-health-watches", "--max-health-watches-per-connection",
                                    "--max-health-watches"};

// What every call consults: tokens, slots, refusal counts, and whether the front end is
// stopping. Owned by main, outliving the server.
struct Guards {
  Guards(long max_rpcs, long per_connection, long per_client, long max_watches, long watches_per_connection)
      : rpcs({"concurrent calls", max_rpcs, per_connection, per_client,
              {kReasonMaxConcurrentRpcs, kReasonMaxRpcsPerConnection, kReasonMaxRpcsPerClient},
              {kRpcFlags[0], kRpcFlags[1], kRpcFlags[2]}}),
        watches({"health Watch streams", max_watches, watches_per_connection, max_watches,
                 {kReasonMaxHealthWatches, kReasonMaxHealthWatchesPerConnection, kReasonMaxHealthWatches},
                 {kWatchFlags[0], kWatchFlags[1], kWatchFlags[2]}}),
        waiting("calls", max_rpcs, per_connection, per_client, kRpcFlags),
        health_waiting("health calls", max_watches, watches_per_connection, 0, kWatchFlags) {}
  TokenSet tokens;
  AuthFailures auth_failures;
  Refusals refusals;
  Slots rpcs;     // every call but health's, once its request message is there
  Slots watches;  // health Watch streams
  // Calls whose headers have come and whose request message has not (waiting.h),
  // authorised ones and health's apart (the latter with the Watch limits, none per client),
  // so that no client can hold an unbounded number of them until --first-message-ms cuts
  // them, and none can keep out a call whose message is on its way.
  Waiting waiting;
  Waiting health_waiting;
  // The public port's connections (set before the server starts): told how each call
  // ended, for the premature-reset guard.
  Connections *connections = nullptr;
  std::atomic<bool> stopping{false};
};

}  // namespace nlmserve_frontend

#endif  // NLMSERVE_FRONTEND_GUARDS_H
