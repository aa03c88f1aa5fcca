"""Loading the repository's scripts, for the files that import it from here; the helper lives in
tests/_helpers.py."""

from tests._helpers import ROOT, load_repo_script  # noqa: F401
