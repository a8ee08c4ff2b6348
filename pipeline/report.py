"""The experiment's report: a table on stdout, Markdown, JSON and a PNG bar chart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..moses_plugin.nbest import write_text_atomic

COLUMNS = ("system", "test BLEU", "Δ vs baseline", "p-value", "dev BLEU", "NLM0 weight", "signature")


def _cells(row: dict[str, Any]) -> list[str]:
    nlm = row["weights"].get("NLM0")
    return [
        row["system"],
        f"{row['test_bleu']:.2f}" + (f" ± {row['test_bleu_sd']:.2f}" if len(row.get("runs", [])) > 1 else ""),
        f"{row['delta']:+.2f} vs {row['baseline']}" if row.get("delta") is not None else "",
        f"{row['p_value']:.4f}" if row.get("p_value") is not None else "",
        f"{row['dev_bleu']:.2f}" if row.get("dev_bleu") is not None else "",
        f"{nlm[0]:.4f}" if nlm else "",
        row["signature"],
    ]


def format_table(report: dict[str, Any]) -> str:
    """A plain-text table of the report's rows."""
    rows = [list(COLUMNS)] + [_cells(r) for r in report["rows"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    lines.append(f"model {report.get('model_hash', '')}")
    return "\n".join(lines)


def to_markdown(report: dict[str, Any]) -> str:
    out = ["# Rescoring with NLM0: BLEU on the test set", ""]
    if report.get("mert_runs", 1) > 1:
        tuner = report.get("tuner", "mert").upper()
        out += [f"Each tuned system was tuned {report['mert_runs']} times ({tuner} seeds differ): BLEU is the mean ± the "
                "standard deviation of the runs, Δ the difference of the means, the p-value a paired bootstrap over "
                "all runs' outputs joined (run r against run r of the baseline).", ""]
    if any(row["system"] == "moses+NLM0" for row in report["rows"]):
        out += ["moses+NLM0 keeps the decoder's weights and sets NLM0's by an exact line search on dev (MERT's, "
                "along that one weight): its BLEU-best value, the same for either tuner and every seed, so it is "
                "tuned once.", ""]
    out.append("| " + " | ".join(COLUMNS) + " |")
    out.append("|" + "---|" * len(COLUMNS))
    for row in report["rows"]:
        cells = _cells(row)
        cells[-1] = "`" + cells[-1].replace("|", "\\|") + "`"  # a pipe inside a table cell must be escaped
        out.append("| " + " | ".join(cells) + " |")
    out += ["", f"Model hash: `{report.get('model_hash', '')}`", ""]
    out.append("Weights (L1-normalised, moses.ini order" + ("; the first run's" if report.get("mert_runs", 1) > 1 else "") + "):")
    out.append("")
    for row in report["rows"]:
        weights = "; ".join(f"{k}= " + " ".join(f"{v:.4f}" for v in vs) for k, vs in row["weights"].items())
        out.append(f"- {row['system']}: {weights}")
    for row in report["rows"]:
        runs = row.get("runs", [])
        if len(runs) > 1:
            each = ", ".join(f"seed {r['seed']}: test {r['test_bleu']:.2f}"
                             + (f" / dev {r['dev_bleu']:.2f}" if r.get("dev_bleu") is not None else "") for r in runs)
            out.append(f"- {row['system']} runs: {each}")
    for name, stats in report.get("rescore", {}).items():
        out.append(f"- rescoring {name}: {stats.get('hypotheses', 0)} hypotheses, {stats.get('ngrams', 0)} n-grams,"
                   f" distinct/total {stats.get('distinct_share', stats.get('dedup_rate', 0)):.3f}, {stats.get('seconds', 0):.1f} s")
    if "seconds" in report:
        out.append(f"- whole run: {report['seconds']:.0f} s")
    return "\n".join(out) + "\n"


def save_chart(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r["system"] for r in rows]
    values = [r["test_bleu"] for r in rows]
    errors = [r.get("test_bleu_sd", 0.0) for r in rows]
    bars = ax.bar(names, values, yerr=errors if any(errors) else None, capsize=4,
                  color=["#888888" if "NLM0" not in n else "#1f77b4" for n in names])
    for bar, row in zip(bars, rows):
        label = f"{row['test_bleu']:.2f}"
        if row.get("p_value") is not None:
            label += f"\np={row['p_value']:.3f}"
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("test BLEU")
    ax.set_ylim(min(values) - 2, max(values) + 2)
    ax.set_title("Test BLEU without and with NLM0")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save_report(report: dict[str, Any], work: Path) -> None:
    """results.md, results.json and bleu.png in ``work`` (``results.mira.md`` … for MIRA's
    table, ``results[.mira].KN1.md`` … with ``--kenlm``, so one workdir keeps every table);
    their paths go into ``report['files']``."""
    tuner, kenlm_name = report.get("tuner", "mert"), report.get("kenlm_name")
    tag = ("" if tuner == "mert" else f".{tuner}") + (f".{kenlm_name}" if kenlm_name else "")
    files = {"markdown": str(work / f"results{tag}.md"), "json": str(work / f"results{tag}.json"),
             "chart": str(work / f"bleu{tag}.png")}
    report["files"] = files
    write_text_atomic(files["markdown"], to_markdown(report))
    write_text_atomic(files["json"], json.dumps(report, indent=2, sort_keys=True))
    save_chart(report, Path(files["chart"]))
