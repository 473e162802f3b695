"""What to tell a job whose code imports a module that is nowhere: neither on the node nor in
the job's own environment (the worker runs in the latter, layered over the former, so what its
interpreter cannot find is missing from both). The job's packages come from the requirements.txt
beside its code, so that is where the module's package goes. A module's name is not always its
package's (`import sklearn` comes from scikit-learn): the advice says "the package that
provides" it, and names the package for the best-known of those."""

from __future__ import annotations

import importlib.util

PACKAGE_OF = {
    "sklearn": "scikit-learn",
    "skimage": "scikit-image",
    "cv2": "opencv-python-headless",
    "PIL": "pillow",
    "yaml": "PyYAML",
    "bs4": "beautifulsoup4",
    "attr": "attrs",
    "dateutil": "python-dateutil",
}
"""Modules whose package has another name, as users meet them most."""


def missing_module(err: BaseException) -> str | None:
    """The top-level module that `err` (or an exception it was raised from, or while handling)
    did not find and that this interpreter cannot find either; None if there is none."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, ModuleNotFoundError) and cause.name:
            top = cause.name.split(".", 1)[0]
            try:
                found = importlib.util.find_spec(top) is not None
            except (ImportError, ValueError):
                found = False
            return None if found else top
        cause = cause.__cause__ or cause.__context__
    return None


def missing_module_advice(err: BaseException) -> str:
    """What to do about `err`, if it is a module that is installed neither on the node nor in the
    job's environment (see missing_module): a sentence to append to its message; else ""."""
    module = missing_module(err)
    if module is None:
        return ""
    known = PACKAGE_OF.get(module)
    package = f"{known} (the package that provides {module!r})" if known else f"the package that provides {module!r}"
    return (f". {module!r} is installed neither on the node nor in the job's packages: add {package} to the "
            "requirements.txt beside the code")
