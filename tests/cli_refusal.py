"""The one error line a refused `longqa` command prints, for the tests of what each command refuses."""

from longqa.cli import main


def refusal(capsys, argv: list[str]) -> str:
    """The one error line of ``longqa ARGV``, which must exit 2 without a traceback."""
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and "Traceback" not in err and len(errors) == 1, err
    return errors[0].removeprefix("longqa: error: ")
