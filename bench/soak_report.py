"""The soak's verdict and its tables (bench/soak.py): what a run missed of the target, and
the Markdown that ``--doc`` writes between the soak markers (every table), between the
summary markers (the verdict alone) and between the cell markers (one table cell)."""

from __future__ import annotations

from typing import Any

from bench._common import shown_command

MEMORY_LIMIT = 1.10  # settled / start, per process
BEGIN, END = "<!-- soak:begin -->", "<!-- soak:end -->"
SUMMARY_BEGIN, SUMMARY_END = "<!-- soak summary:begin -->", "<!-- soak summary:end -->"
CELL_BEGIN, CELL_END = "<!-- soak cell:begin -->", "<!-- soak cell:end -->"  # inside a table's cell


def misses(run: dict[str, Any]) -> list[str]:
    """Why one front end's run missed the target (empty: met): failed or wrong authorised
    answers (or none answered), failed probes, a replica that did not restart, a process
    whose memory after the settle is over 10% above its start."""
    every = run["authorised"]["all"]
    out = []
    if sum(every["failed"].values()):
        out.append(f"{sum(every['failed'].values())} authorised requests failed")
    if every["wrong"]:
        out.append(f"{every['wrong']} wrong answers")
    if not every["answered"]:
        out.append("no authorised answer")
    if run["health_probes"]["failed"]:
        out.append(f"{run['health_probes']['failed']} failed probes")
    if run["faults"].get("restart_failed"):
        out.append(f"{run['faults']['restart_failed']} failed restarts")
    for m in run["memory"]:
        if m["settled_over_start"] is None or m["settled_over_start"] > MEMORY_LIMIT:
            out.append(f"{m['replica']} {m['process']} memory {m['start_mb']} -> {m['settled_mb']} MB")
    return out


def _outcomes(counts: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "0"


def _hostile_rows(cfg: dict[str, Any]) -> dict[str, str]:
    """What each hostile client's row says it did (per replica)."""
    h, per = cfg["hostile"], cfg["max_concurrent_rpcs"]
    flood = cfg["max_health_watches"] // h["watch_per_connection"] + 2
    slow = h["slow_connections"]
    return {
        "watch": f"Watch streams held open, one per connection ({per})",
        "watch_flood": f"Watch flood: {flood} connections x {h['watch_per_connection']} streams "
                       f"(`--max-health-watches {cfg['max_health_watches']}`)",
        "half_open": f"ScoreNgrams calls that never send ({per} at a time, re-opened when refused)",
        "half_open_health": f"health Check calls that never send: {flood} connections x {h['watch_per_connection']} "
                            f"(`--max-health-watches {cfg['max_health_watches']}`), re-opened when ended",
        "random": "random bytes on three methods",
        "random_token": "random bytes, with a token",
        "oversized": "messages over `--max-message-bytes`",
        "oversized_token": "the same with a token",
        "gzip_bomb": f"gzip requests inflating to {h['gzip_bomb_bytes'] // 2**20} MiB, every {h['gzip_every']:g} s",
        "gzip_bomb_token": "the same with a token",
        "deadline_1ms": f"ScoreNgrams with a 1 ms deadline, with a token ({h['deadline_calls']} every 0.1 s)",
        "invented_methods": f"{h['invented_methods']} invented method names (half with a token)",
        "never_read": f"GetScoringTables{', GetVocabulary and ScoreNgrams' if h.get('never_read_unary') else ' and GetVocabulary'}"
                      " never read (receive window 0), with a token: "
                      f"{h['never_read_connections']} connections x {h['never_read_calls']} calls",
        "rapid_reset": f"rapid reset: {h['reset_burst']} HEADERS + RST_STREAM every {h['reset_every']:g} s on one "
                       "connection",
        "big_metadata_unacked": f"half-open calls with {h['big_metadata_bytes'] // 1024} KiB of metadata before the "
                                f"SETTINGS ACK ({h['big_metadata_calls'] // 2} held)",
        "big_metadata": "half-open calls with the metadata the server's SETTINGS allow "
                        f"({h['big_metadata_calls'] // 2} held)",
        "slow": f"connections silent, stopped in the preface, stopped in a header block ({slow} of each)",
        "raw_tcp_bytes": "raw TCP connections of random bytes",
        "vanishing": f"clients killed with {h['vanish_calls']} x {h['vanish_ngrams']} n-grams in flight, with a "
                     f"token, every {h['vanish_every']:g} s",
        "errors": "hostile clients that ended with an error of their own",
    }


def _probe_detail(h: dict[str, Any]) -> str:
    """The probes' times and failures, where the run recorded them (older runs did not)."""
    if "p50_ms" not in h:
        return ""
    where = ("the probes ran in a process of their own" if h.get("own_process") else
             "the soak's own process is busy with its clients")  # older runs probed from it
    out = (f", each from its channel's creation to the answer (the deadline, 2 s, counts from the call; {where}) "
           f"in p50 {h['p50_ms']:.0f} ms, p99 {h['p99_ms']:.0f} ms, "
           f"max {h['max_ms']:.0f} ms; the kernel dropped {h['accept_queue_drops']} connections at a full accept "
           "queue")
    for f in h["failures"]:
        out += (f"; at {f['at']} a probe of {f['replica']} got {f['code']} after {f['seconds']} s "
                f"({'no connection' if f['phase'] == 'connect' else 'connected, no answer'})")
    return out


def _verdict_lines(result: dict[str, Any]) -> list[str]:
    """The run's command and settings, and its table of one row per front end."""
    cfg, runs = result["config"], result["runs"]
    lines = [f"`{shown_command(result['command'])}`: {cfg['minutes']:g} minute{'' if cfg['minutes'] == 1 else 's'} of "
             f"attack per front end on "
             f"{result['machine']['cores']} cores ({result['machine']['cpu']}), two replicas with a token file of "
             f"two tokens (the authorised clients', the hostile ones'), `--max-concurrent-rpcs "
             f"{cfg['max_concurrent_rpcs']}`, `--max-rpcs-per-client {cfg['max_rpcs_per_client']}`, "
             f"`--max-health-watches {cfg['max_health_watches']}`, {cfg['warmup_seconds']:g} s of warm-up before, "
             f"{cfg['settle_seconds']:g} s to settle after"
             + (f", gRPC's `{cfg['poll_engine']}` polling engine in the replicas" if cfg.get("poll_engine") else "")
             + (f", the replicas also given `{' '.join(cfg['serve_args'])}`" if cfg.get("serve_args") else "")
             + ".",
             "",
             "| front end | authorised sent | answered | failed | wrong | retried by the client | p50 ms | p99 ms | "
             "probes sent | failed | memory settled / start (worst process) | target |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        c, h = r["authorised"]["all"], r["health_probes"]
        worst = max((m["settled_over_start"] or float("inf") for m in r["memory"]), default=float("nan"))
        target = "**met**" if r["target_met"] else "**not met**: " + "; ".join(r["missed"])
        lines.append(f"| {r['frontend']} | {c['sent']} | {c['answered']} | {_outcomes(c['failed'])} | {c['wrong']} | "
                     f"{_outcomes(c['retried'])} | {c['p50_ms']} | {c['p99_ms']} | {h['sent']} | {h['failed']} | "
                     f"{worst:.2f} | {target} |")
    return lines


def render_summary(result: dict[str, Any]) -> str:
    """The verdict alone (settings, one row per front end, the target), between the summary
    markers: what docs/operating.md shows; the whole run is :func:`render`'s."""
    return "\n".join([SUMMARY_BEGIN, *_verdict_lines(result), "", _target_line(result), SUMMARY_END]) + "\n"


def render_cell(result: dict[str, Any]) -> str:
    """One table cell, between the cell markers (docs/performance-serving.md): whether the
    run lost or got wrong no authorised answer and failed no probe, with its counts."""
    runs = result["runs"]
    sent = sum(r["authorised"]["all"]["sent"] for r in runs)
    lost = sum(sum(r["authorised"]["all"]["failed"].values()) + r["authorised"]["all"]["wrong"] for r in runs)
    probes = sum(r["health_probes"]["sent"] for r in runs)
    failed = sum(r["health_probes"]["failed"] for r in runs)
    verdict = "met" if lost == 0 and failed == 0 else "**not met**"
    names = " and ".join(f"`{r['frontend']}`" for r in runs)
    return (f"{CELL_BEGIN}{verdict} in the last run ({result['config']['minutes']:g} minutes per front end, "
            f"{names}): {lost} of {sent:,} authorised requests lost or wrong, {failed} of {probes:,} probes "
            f"failed{CELL_END}")


def _target_line(result: dict[str, Any]) -> str:
    return ("Target (per front end: 0 failed or wrong answers, 0 failed probes, every process's memory after the "
            "settle within 10% of its start): " + ("**met**." if result["target_met"] else "**not met**."))


def _heap(m: dict[str, Any], when: str) -> str:
    """malloc's heap in use at ``when`` (``serve``'s and the front end's SIGUSR1 line), "–"
    where it was not taken (a run before the soak took it, a process that did not answer)."""
    value = m.get(f"{when}_heap_mb")
    return "–" if value is None else str(value)


def render(result: dict[str, Any]) -> str:
    """Every table of the run (its verdict, each authorised client, each process's memory,
    each hostile client, the probes and faults), between the soak markers."""
    cfg, runs = result["config"], result["runs"]
    names = [r["frontend"] for r in runs]
    lines = [BEGIN, *_verdict_lines(result)]
    lines += ["", "| authorised client | front end | sent | answered | failed | wrong | retried | p50 ms | p99 ms |",
              "|---|---|---|---|---|---|---|---|---|"]
    for kind in ("decoder", "rescoring", "reconnecting", "strict"):
        for r in runs:
            c = r["authorised"][kind]
            lines.append(f"| {kind} | {r['frontend']} | {c['sent']} | {c['answered']} | {_outcomes(c['failed'])} | "
                         f"{c['wrong']} | {_outcomes(c['retried'])} | {c['p50_ms']} | {c['p99_ms']} |")
    lines += ["", "| resident memory, MB | front end | start | attack end | peak | settled | settled / start "
              "| malloc in use, MB: start | settled |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        for m in r["memory"]:
            restarted = f" (restarted {m['restarts']} times)" if m["restarts"] else ""
            lines.append(f"| {m['replica']} {m['process']}{restarted} | {r['frontend']} | {m['start_mb']} | "
                         f"{m['attack_end_mb']} | {m['peak_mb']} | {m['settled_mb']} | {m['settled_over_start']} | "
                         f"{_heap(m, 'start')} | {_heap(m, 'settled')} |")
    rows = _hostile_rows(cfg)
    lines += ["", "| hostile client (no token unless said; sizes per replica, counts of both) | "
              + " | ".join(names) + " |",
              "|---" * (len(names) + 1) + "|"]
    for name, what in rows.items():
        if any(name in r["hostile"] for r in runs):
            lines.append(f"| {what} | " + " | ".join(_outcomes(r["hostile"].get(name, {})) for r in runs) + " |")
    lines.append("")
    for r in runs:
        f, counts = r["faults"], r["server_counts"]
        unauthenticated = sum(v for k, v in counts.items() if 'code="UNAUTHENTICATED"' in k)
        limits = ", ".join(f"{k.split('=', 1)[1].rstrip('}')} {v}" for k, v in counts.items()
                           if k.startswith("nlmserve_refused_total")) or "none"
        sizes = "; ".join(f"{name} {m['start_bytes'] // 1024} KiB -> {m['end_bytes'] // 1024} KiB ({m['end_series']} "
                          "series)" for name, m in r["metrics"].items())
        h = r["health_probes"]
        lines += [f"{r['frontend']}: health probes {h['sent']} sent, {h['failed']} failed "
                  f"({h['skipped_while_killed']} skipped while their replica was killed){_probe_detail(h)}; "
                  f"faults: {f.get('sighup_bad', 0)} SIGHUP reloads of bad files, {f.get('sighup_good', 0)} of good "
                  f"ones, {f.get('kill_restart', 0)} SIGKILLs of replica B (restarted on its port); the model servers "
                  f"counted {unauthenticated} calls refused UNAUTHENTICATED and, by limit (`nlmserve_refused_total`): "
                  f"{limits}; /metrics {sizes}.", ""]
    lines += [_target_line(result), END]
    return "\n".join(lines) + "\n"
