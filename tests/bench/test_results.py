"""bench/results.py: a run's block goes in its script's section of bench/RESULTS.md and replaces
the one before it; the rest of the file stays as it was."""

import re
import sys

from bench.results import RESULTS, run_header, write_results

START = "<!-- bench/demo.py: latest run (written by the script) -->"
END = "<!-- bench/demo.py: end of latest run -->"


def test_a_run_gets_a_section_and_the_next_run_replaces_its_block(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Engine benchmark results\n\nNotes by hand.\n")
    write_results("demo.py", "Demo", "first run", path=results)
    write_results("other.py", "Other", "other run", path=results)
    write_results("demo.py", "Demo", "second run", path=results)
    text = results.read_text()
    assert text.startswith("# Engine benchmark results\n\nNotes by hand.\n\n# Demo (bench/demo.py)")
    assert f"# Demo (bench/demo.py)\n\n{START}\nsecond run\n{END}\n" in text
    assert "first run" not in text and text.count("# Demo") == 1
    assert "# Other (bench/other.py)" in text and "other run" in text


def test_a_section_written_by_hand_gets_the_block_under_its_title(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Demo (bench/demo.py)\n\nOlder runs, by hand.\n\n# Next\n")
    write_results("demo.py", "Demo", "a run", path=results)
    text = results.read_text()
    assert text.index(START) < text.index("a run") < text.index(END) < text.index("Older runs")
    assert text.count("# Demo") == 1 and text.endswith("# Next\n")


def test_a_run_header_names_the_command_the_date_and_the_machine(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench/demo.py", "--rounds", "2"])
    command, blank, date = run_header("demo.py", ". Load 0.5.", note=" (= `make bench-demo`)")
    assert command == "Command: `.venv/bin/python bench/demo.py --rounds 2` (= `make bench-demo`)"
    assert blank == ""
    assert re.fullmatch(
        r"Date: \d{4}-\d\d-\d\d \d\d:\d\d UTC\. Machine: \d+ CPU cores \(.*\)\. Load 0\.5\.", date
    )


def test_every_writer_names_a_section_that_results_md_has():
    """A script whose section is not found would append a second one instead of replacing its
    block."""
    writers = [
        script
        for script in sorted(RESULTS.parent.glob("*.py"))
        if script.name != "results.py" and "write_results(" in script.read_text()
    ]
    assert len(writers) >= 7
    text = RESULTS.read_text()
    for script in writers:
        (heading,) = re.findall(
            rf'write_results\(\s*"{re.escape(script.name)}",\s*"([^"]+)"', script.read_text()
        )
        assert f"# {heading} (bench/{script.name})" in text
        assert f"<!-- bench/{script.name}: latest run (written by the script) -->" in text
        assert f"<!-- bench/{script.name}: end of latest run -->" in text
