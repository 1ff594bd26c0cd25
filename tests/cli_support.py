"""Running the command line in-process from tests, and what its user errors must look like."""
from tierflow import cli


def run_main(*args, capsys):
    """(exit code, stdout, stderr) of ``tierflow ARGS``."""
    try:
        code = cli.main(list(args))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_error_line(err: str, fragments) -> None:
    """A user error: one ``tierflow: error:`` line holding every fragment."""
    assert len(err.strip().splitlines()) == 1 and err.startswith("tierflow: error: "), err
    assert all(f in err for f in fragments), err
