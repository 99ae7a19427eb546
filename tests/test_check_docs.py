"""scripts/check_docs.py, which CI runs after the suite: it finds every command of the docs' bash
blocks (continued lines joined, comments and other languages' blocks left out), skips or shortens
by its rules alone, and fails where a command fails."""
import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "check_docs.py"


def _script():
    spec = importlib.util.spec_from_file_location("check_docs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_docs"] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_the_commands_of_bash_blocks_are_found_in_order_with_continued_lines_joined(tmp_path):
    check = _script()
    doc = tmp_path / "doc.md"
    doc.write_text("Text\n\n```bash\necho one   # a comment\n# a line of comment\npython -m x \\\n    --flag y\n```\n\n"
                   "```python\nprint('not a command')\n```\n\n```bash\necho two\n```\n")
    assert check.commands(doc) == [(4, "echo one   # a comment"), (6, "python -m x  --flag y"), (15, "echo two")]
    assert check.rule_for("python -m mlkv_torch.train c.yaml 'data.criteo.train=[/data/kaggle/train.txt]'").reason \
        == "the reader's own data or hosts"
    assert check.rule_for("bash scripts/setup.sh").extra is None
    assert check.rule_for("python -m mlkv_torch.train configs/synthetic_large.yaml").extra.startswith("train.steps=")
    assert check.rule_for("python -m mlkv_torch.train configs/quickstart.yaml output_dir=runs/first") is None


def test_every_doc_it_checks_has_commands_and_a_failing_command_fails_it(tmp_path):
    listed = subprocess.run([sys.executable, str(SCRIPT), "--list"], capture_output=True, text=True, cwd=REPO)
    assert listed.returncode == 0, listed.stderr
    check = _script()
    for doc in check.DOCS:
        assert f"[docs] {doc}:" in listed.stdout, doc
    code, _, tail = check.run("echo out; echo err >&2; exit 3")
    assert code == 3 and "out" in tail and "err" in tail
