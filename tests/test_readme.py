"""The README's two set-up commands are the ones CI runs and the ones that exist."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_has_two_setup_commands_and_ci_runs_the_test_one():
    setup = (ROOT / "README.md").read_text().split("## Set up", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.+?)\n```", setup)
    assert len(commands) == 2
    main_job, tests = commands
    assert main_job == "pip install torch==2.13.0 -e . && longqa train"
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests in ci and "torch==2.13.0" in ci
