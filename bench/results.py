"""Regenerate bench/RESULTS.md from the per-benchmark tables in bench/results/*.md.

    python bench/data_pipeline.py && python bench/remat.py && python bench/results.py
"""
from __future__ import annotations

from pathlib import Path

BENCH = Path(__file__).resolve().parent
ORDER = ["data_pipeline", "remat"]

HEADER = """# r1jax benchmark results

Every table below was produced by the command printed above it; `python bench/results.py`
reassembles this file from `bench/results/*.md`. Timings are from shared 2-core CPU machines:
compare rows within one table (measured side by side in one run), not across tables.
"""


def main() -> None:
    parts = [HEADER]
    names = ORDER + sorted(p.stem for p in (BENCH / "results").glob("*.md") if p.stem not in ORDER)
    for name in names:
        path = BENCH / "results" / f"{name}.md"
        if path.is_file():
            parts.append(path.read_text().replace("\n# ", "\n## ").replace("# ", "## ", 1))
    (BENCH / "RESULTS.md").write_text("\n".join(parts))


if __name__ == "__main__":
    main()
