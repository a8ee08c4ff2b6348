"""bench/soak.py: the bad files its faults put in place, the HTTP/2 its raw clients write, a
table that says the target was missed when one authorised request failed or memory stayed
up, and a tiny run of every hostile client against each front end (what the servers answer
is the soak's to report, not this test's: here each attacker must have done its part)."""

from __future__ import annotations

import copy
import dataclasses
import json
import socket
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from support import REPO
from test_cpp_client import driver  # noqa: F401 - the driver fixture builds build/native (or skips)

from bench import h2, soak, soak_report
from bench.soak_hostile import ATTACKS, HostileConfig

#: The tallies a run of every attack reports (an attack may keep several).
TALLIES = {"watch", "watch_flood", "half_open", "half_open_health", "random", "random_token", "oversized", "oversized_token",
           "gzip_bomb", "gzip_bomb_token", "deadline_1ms", "invented_methods", "never_read", "rapid_reset",
           "big_metadata", "big_metadata_unacked", "slow", "raw_tcp_bytes", "vanishing"}


def test_the_faults_files(tmp_path: Path) -> None:
    good = tmp_path / "good.nlm"
    good.write_bytes(b"x" * 1000)
    dst = tmp_path / "served.nlm"
    soak._put(good, dst, "good")
    assert dst.read_bytes() == good.read_bytes()
    soak._put(good, dst, "truncated")
    assert dst.read_bytes() == good.read_bytes()[:-100]
    soak._put(good, dst, "fifo")
    assert stat.S_ISFIFO(dst.stat().st_mode)
    soak._put(good, dst, "garbage")  # over the FIFO
    assert dst.is_file() and dst.stat().st_size == 4096
    soak._put(good, dst, "good")
    assert dst.read_bytes() == good.read_bytes()


def test_header_blocks_read_back_and_split_into_frames() -> None:
    fields = [(":method", "POST"), (":path", "/a/b"), ("x-big", "v" * 70_000), ("x-empty", "")]
    block = h2.header_block(fields)
    assert h2.HpackDecoder().decode(block) == dict(fields)
    frames = h2.headers_frames(3, block)
    kinds, at = [], 0
    while at < len(frames):  # HEADERS, then CONTINUATIONs, END_HEADERS on the last only
        length = int.from_bytes(frames[at : at + 3], "big")
        kinds.append((frames[at + 3], frames[at + 4], int.from_bytes(frames[at + 5 : at + 9], "big")))
        at += 9 + length
        assert length <= h2.FRAME_BYTES
    assert at == len(frames) and len(kinds) == -(-len(block) // h2.FRAME_BYTES)
    assert kinds[0] == (h2.HEADERS, 0, 3) and kinds[-1] == (h2.CONTINUATION, h2.END_HEADERS, 3)
    # A server's trailers: indexed static entry (:status 200), then a literal with incremental
    # indexing (grpc-status 8) read again from the dynamic table by its index (62).
    decoder = h2.HpackDecoder()
    assert decoder.decode(b"\x88" + b"\x40\x0bgrpc-status\x018") == {":status": "200", "grpc-status": "8"}
    assert decoder.decode(b"\xbe") == {"grpc-status": "8"}


def test_unknown_attacks_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown attacks nope"):
        HostileConfig(attacks=("watch", "nope"))
    with pytest.raises(SystemExit):
        soak.main(["--attacks", "watch,nope"])


def test_the_table_says_whether_the_target_was_met() -> None:
    result = json.loads((REPO / "bench" / "results" / "soak.json").read_text(encoding="utf-8"))
    table = soak_report.render(result)
    assert table.startswith(soak_report.BEGIN) and table.rstrip().endswith(soak_report.END)
    doc = (REPO / "experiments" / "hostile-clients.md").read_text(encoding="utf-8")
    assert table in doc  # the page shows the recorded run, as the script wrote it
    summary = soak_report.render_summary(result)
    assert summary in (REPO / "docs" / "operating.md").read_text(encoding="utf-8")
    assert soak_report.render_cell(result) in (REPO / "docs" / "performance-serving.md").read_text(encoding="utf-8")
    verdict = "\n".join(soak_report._verdict_lines(result))
    assert verdict in summary and verdict in table and "| authorised client |" not in summary
    for run in result["runs"]:
        assert f"| {run['frontend']} | {run['authorised']['all']['sent']} |" in table
        assert run["target_met"] == (not soak_report.misses(run))
    assert result["target_met"] == all(not soak_report.misses(run) for run in result["runs"])
    met = copy.deepcopy(result["runs"][0])
    met["authorised"]["all"].update(failed={}, wrong=0, answered=max(1, met["authorised"]["all"]["answered"]))
    met["health_probes"]["failed"] = 0
    met["faults"].pop("restart_failed", None)
    for m in met["memory"]:
        m["settled_over_start"] = 1.0
    assert soak_report.misses(met) == []
    for damage in ("failed", "wrong", "probe", "restart", "memory"):
        bad = copy.deepcopy(met)
        if damage == "failed":
            bad["authorised"]["all"]["failed"] = {"ServerUnavailableError": 2}
        elif damage == "wrong":
            bad["authorised"]["all"]["wrong"] = 1
        elif damage == "probe":
            bad["health_probes"]["failed"] = 1
        elif damage == "restart":
            bad["faults"]["restart_failed"] = 1
        else:
            bad["memory"][-1]["settled_over_start"] = 1.11
        assert soak_report.misses(bad), damage
    shown = copy.deepcopy(result)
    shown["runs"][0]["authorised"]["decoder"]["failed"] = {"ServerUnavailableError": 2}
    shown["runs"][0]["target_met"], shown["target_met"] = False, False
    table = soak_report.render(shown)
    assert "ServerUnavailableError 2" in table and "**not met**" in table
    assert "polling engine" not in table
    shown["config"]["poll_engine"] = "poll"
    assert "to settle after, gRPC's `poll` polling engine in the replicas." in soak_report.render(shown)
    shown["config"]["serve_args"] = ["--max-connection-age-seconds", "60"]
    assert ("to settle after, gRPC's `poll` polling engine in the replicas, the replicas also given "
            "`--max-connection-age-seconds 60`.") in soak_report.render(shown)


class _Replica:
    """A replica for the probe (its ``up`` set, a log of one line) on ``port``."""

    def __init__(self, tmp: Path, port: int) -> None:
        self.target, self.name = f"127.0.0.1:{port}", "A"
        self.up = threading.Event()
        self.up.set()
        self.log = tmp / "A.log"
        self.log.write_text("before\n", encoding="utf-8")

    def log_size(self) -> int:
        return self.log.stat().st_size

    def log_since(self, offset: int) -> list[str]:
        return self.log.read_text(encoding="utf-8")[offset:].splitlines()


def _first_failure(replica: _Replica) -> dict[str, Any]:
    probes, stop = soak.Probes(), threading.Event()
    thread = threading.Thread(target=soak.probe, args=([replica], stop, probes), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not probes.failures and time.monotonic() < deadline:
        time.sleep(0.1)
    stop.set()
    thread.join(10)
    summary = probes.summary()
    assert summary["failed"] >= 1 and summary["sent"] >= summary["failed"]
    assert summary["max_ms"] >= 1000 * soak.PROBE_DEADLINE
    assert isinstance(summary["accept_queue_drops"], int) and summary["accept_queue_drops"] >= 0
    first: dict[str, Any] = summary["failures"][0]
    assert first["replica"] == "A" and first["code"] == "DEADLINE_EXCEEDED", first
    assert soak.PROBE_DEADLINE <= first["seconds"] < soak.PROBE_DEADLINE + 1.0
    assert first["log"] == [] and first["t"] >= 0.5  # nothing logged since; the first probe after 0.5 s
    detail = soak_report._probe_detail(summary)
    assert f"a probe of A got DEADLINE_EXCEEDED after {first['seconds']} s" in detail
    assert "the probes ran in a process of their own" in detail
    return first


def test_a_probe_without_a_connection_is_a_failure_of_the_connect_phase(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as sock:  # takes connections, never speaks HTTP/2
        first = _first_failure(_Replica(tmp_path, sock.getsockname()[1]))
    assert first["phase"] == "connect"


class _SlowHealth(health_pb2_grpc.HealthServicer):
    def Check(self, request: Any, context: Any) -> Any:
        time.sleep(soak.PROBE_DEADLINE + 0.5)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def test_a_probe_connected_but_not_answered_is_a_failure_of_the_answer_phase(tmp_path: Path) -> None:
    server = grpc.server(ThreadPoolExecutor(4))
    health_pb2_grpc.add_HealthServicer_to_server(_SlowHealth(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        first = _first_failure(_Replica(tmp_path, port))
    finally:
        server.stop(None)
    assert first["phase"] == "answer"


def test_the_probes_text_says_where_they_ran() -> None:
    seen = {"p50_ms": 4.0, "p99_ms": 20.0, "max_ms": 30.0, "accept_queue_drops": 0, "failures": []}
    assert "the soak's own process is busy with its clients" in soak_report._probe_detail(seen)  # a run before the change
    assert "the probes ran in a process of their own" in soak_report._probe_detail({**seen, "own_process": True})


def test_listen_drops_reads_the_kernels_counters() -> None:
    def read() -> int:
        text = Path("/proc/net/netstat").read_text()
        names, values = [line for line in text.splitlines() if line.startswith("TcpExt:")]
        row = dict(zip(names.split()[1:], values.split()[1:]))
        return int(row["ListenOverflows"]) + int(row["ListenDrops"])

    before = read()
    assert before <= soak.listen_drops() <= read()  # the counters only grow


def tiny(model: Path, frontend: str) -> soak.SoakConfig:
    """Every attack, a few of each, for 6 s: a reload of each replica and a kill of B."""
    return soak.SoakConfig(
        model=str(model), minutes=0.1, frontend=frontend, decoders=1, rescorers=1, max_concurrent_rpcs=8, max_rpcs_per_client=4,
        max_health_watches=16, fault_every=1.0, warmup_seconds=0.5, settle_seconds=0.5, quiet_seconds=0.5,
        hostile=HostileConfig(never_read_connections=1, never_read_calls=4, reset_burst=200, reset_every=1.0,
                              big_metadata_calls=2, big_metadata_bytes=256 * 1024, gzip_bomb_bytes=16 * 2**20,
                              gzip_every=1.0, deadline_calls=2, invented_methods=40, slow_connections=2,
                              vanish_every=2.0, vanish_calls=4, vanish_ngrams=20_000))


def check_tiny_run(result: dict[str, Any], frontend: str, processes: set[str]) -> None:
    assert set(ATTACKS) == set(result["config"]["hostile"]["attacks"])
    assert {"load_average_1m", "load_average_end_1m"} <= set(result["machine"])  # before and after the soak's own
    (run,) = result["runs"]
    assert run["frontend"] == frontend
    every = run["authorised"]["all"]
    assert every["answered"] > 0 and every["wrong"] == 0, every
    sent = {kind: run["authorised"][kind]["sent"] for kind in ("decoder", "rescoring", "reconnecting", "strict")}
    assert all(sent.values()), sent
    probes = run["health_probes"]
    assert probes["sent"] > 0 and 0 < probes["p50_ms"] <= probes["p99_ms"] <= probes["max_ms"], probes
    assert len(probes["failures"]) == probes["failed"] and probes["accept_queue_drops"] >= 0
    assert run["faults"].get("sighup_bad", 0) >= 2 and run["faults"].get("kill_restart") == 1, run["faults"]
    hostile = run["hostile"]
    assert "errors" not in hostile, hostile.get("errors")
    assert TALLIES <= set(hostile), TALLIES - set(hostile)
    for name in TALLIES:
        assert sum(v for k, v in hostile[name].items() if not k.endswith(("_s_p50", "_s_max"))) > 0, name
    reset = hostile["rapid_reset"]
    assert reset["streams_reset"] == 200 * reset["bursts"] > 0
    assert hostile["never_read"]["calls"] >= 4 * 2  # one connection of 4 calls on each replica
    assert hostile["big_metadata_unacked"]["largest_sent_bytes"] == 256 * 1024
    assert {k.split()[0] for k in hostile["slow"] if k.endswith(" opened")} == {"silent", "mid_preface", "mid_header"}
    assert hostile["vanishing"].get("clients_killed", 0) >= 1
    assert hostile["half_open_health"].get("RESOURCE_EXHAUSTED", 0) >= 1  # cut: more than may wait
    assert sum(hostile["invented_methods"].values()) <= 2 * 40
    assert {(m["replica"], m["process"]) for m in run["memory"]} == {(r, p) for r in "AB" for p in processes}
    assert all(m["start_mb"] > 0 and m["settled_mb"] > 0 for m in run["memory"])
    assert all(0 < m["start_heap_mb"] < m["start_mb"] and 0 < m["settled_heap_mb"] for m in run["memory"]), run["memory"]
    assert [m["restarts"] for m in run["memory"] if m["replica"] == "B"] == [1] * len(processes)
    assert all(m["end_bytes"] > 0 for m in run["metrics"].values())
    assert run["target_met"] == (not run["missed"]) == result["target_met"]
    table = soak_report.render(result)
    for row in ("Watch flood", "rapid reset", "never read", "gzip", "1 ms deadline", "invented method",
                "metadata before the SETTINGS ACK", "stopped in the preface", "killed with"):
        assert f"| {row}" in table or f" {row}" in table, row


def test_a_tiny_soak_of_the_python_front_end_runs_every_attack(tiny_model_path: Path) -> None:
    cfg = dataclasses.replace(tiny(tiny_model_path, "python"), poll_engine="poll",  # the replicas under gRPC's poll
                              serve_args=("--max-connection-age-seconds", "600"))
    result = soak.run(cfg)
    assert result["config"]["poll_engine"] == "poll"
    assert list(result["config"]["serve_args"]) == ["--max-connection-age-seconds", "600"]
    check_tiny_run(result, "python", {"nlmserve serve"})


def test_a_tiny_soak_of_the_native_front_end_runs_every_attack(driver: Path,  # noqa: F811
                                                               tiny_model_path: Path) -> None:
    result = soak.run(tiny(tiny_model_path, "native"))
    check_tiny_run(result, "native", {"nlmserve serve", "nlmserve_frontend"})


def test_serve_args_that_do_not_split_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        soak.main(["--serve-args", "--max-connection-age-seconds '60"])
    assert exit_.value.code == 2
    assert "--serve-args: No closing quotation" in capsys.readouterr().err


def test_a_serve_flag_the_replicas_refuse_is_one_line(tiny_model_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    code = soak.main(["--model", str(tiny_model_path), "--attacks", "", "--minutes", "0.01",
                      "--serve-args", "--no-such-flag 1"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("bench.soak: replica A did not start:") and "--no-such-flag" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_rendering_a_file_that_is_not_a_saved_run_is_one_line(tmp_path: Path) -> None:
    empty = tmp_path / "empty.json"
    empty.write_bytes(b"")
    with pytest.raises(SystemExit) as stopped:
        soak.main(["--render", str(empty)])
    assert str(stopped.value).startswith(f"{empty}: not a saved run's JSON (")


def test_each_doc_gets_the_sections_it_has_markers_for_and_a_rewrite_changes_nothing(tmp_path: Path) -> None:
    result = json.loads((REPO / "bench" / "results" / "soak.json").read_text(encoding="utf-8"))
    full, short, neither = tmp_path / "full.md", tmp_path / "short.md", tmp_path / "neither.md"
    full.write_text(f"# Full\n\n{soak_report.BEGIN}\nold\n{soak_report.END}\n\nafter\n", encoding="utf-8")
    short.write_text(f"{soak_report.SUMMARY_BEGIN}\n{soak_report.SUMMARY_END}\n", encoding="utf-8")
    neither.write_text("nothing to replace\n", encoding="utf-8")
    row = tmp_path / "row.md"
    row.write_text(f"| a | claim | {soak_report.CELL_BEGIN}old{soak_report.CELL_END} | command |\n", encoding="utf-8")
    assert soak.main(["--render", str(REPO / "bench" / "results" / "soak.json"),
                      "--doc", str(full), "--doc", str(short), "--doc", str(row)]) == (0 if result["target_met"] else 1)
    cell = soak_report.render_cell(result)
    assert row.read_text(encoding="utf-8") == f"| a | claim | {cell} | command |\n"  # still one table row
    assert "\n" not in cell and "|" not in cell
    written = full.read_text(encoding="utf-8"), short.read_text(encoding="utf-8")
    assert written[0] == "# Full\n\n" + soak_report.render(result) + "\nafter\n"
    assert written[1] == soak_report.render_summary(result)
    assert "| authorised client |" not in written[1]
    soak.main(["--render", str(REPO / "bench" / "results" / "soak.json"), "--doc", str(full), "--doc", str(short)])
    assert (full.read_text(encoding="utf-8"), short.read_text(encoding="utf-8")) == written  # no blank line added
    short.write_text(f"{soak_report.SUMMARY_BEGIN}\nold\n{soak_report.SUMMARY_END}\n", encoding="utf-8")
    with pytest.raises(SystemExit) as stopped:  # one document without markers: none is written
        soak.main(["--render", str(REPO / "bench" / "results" / "soak.json"), "--doc", str(short),
                   "--doc", str(neither)])
    assert str(stopped.value).startswith(f"{neither}: no section to replace ('{soak_report.BEGIN}'")
    assert neither.read_text(encoding="utf-8") == "nothing to replace\n"
    assert short.read_text(encoding="utf-8") == f"{soak_report.SUMMARY_BEGIN}\nold\n{soak_report.SUMMARY_END}\n"
    binary = tmp_path / "binary.md"
    binary.write_bytes(b"\xd0\x00\xff")
    with pytest.raises(SystemExit) as stopped:
        soak.main(["--render", str(REPO / "bench" / "results" / "soak.json"), "--doc", str(binary)])
    assert str(stopped.value).startswith(f"{binary}: not a text document (")


def test_the_cell_says_whether_anything_was_lost_or_a_probe_failed() -> None:
    result = json.loads((REPO / "bench" / "results" / "soak.json").read_text(encoding="utf-8"))
    runs = result["runs"]
    sent = sum(r["authorised"]["all"]["sent"] for r in runs)
    probes = sum(r["health_probes"]["sent"] for r in runs)
    met = copy.deepcopy(result)
    for r in met["runs"]:
        r["authorised"]["all"].update(failed={}, wrong=0)
        r["health_probes"]["failed"] = 0
    assert soak_report.render_cell(met) == (
        f"{soak_report.CELL_BEGIN}met in the last run (10 minutes per front end, `python` and `native`): 0 of "
        f"{sent:,} authorised requests lost or wrong, 0 of {probes:,} probes failed{soak_report.CELL_END}")
    bad = copy.deepcopy(met)
    bad["runs"][1]["authorised"]["all"]["wrong"] = 2
    bad["runs"][0]["authorised"]["all"]["failed"] = {"ServerUnavailableError": 1}
    bad["runs"][0]["health_probes"]["failed"] = 1
    assert soak_report.render_cell(bad).startswith(f"{soak_report.CELL_BEGIN}**not met** in the last run")
    assert f"3 of {sent:,} authorised requests lost or wrong, 1 of {probes:,} probes failed" in soak_report.render_cell(bad)
