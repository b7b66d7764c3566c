"""settings.py: the one module that reads ``CHECKPOINTER_*`` variables; its getters and ``SETTINGS`` agree.

The reads are found in the source text (no import), the way test_layering.py finds imports.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from checkpointer import settings
from checkpointer.settings import SETTINGS

ROOT = Path(__file__).resolve().parents[2] / "checkpointer"
VARIABLE = re.compile(r"CHECKPOINTER_[A-Z0-9_]+")


def _is_environ(node: ast.AST) -> bool:
    """``os.environ`` or a bare ``environ``."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def _env_keys(tree: ast.AST) -> list[ast.AST]:
    """The key expressions of every environment read: ``os.environ.get(k)``, ``os.environ[k]``,
    ``os.getenv(k)``, ``k in os.environ``, ``os.environ.pop/setdefault(k)``."""
    keys: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            fn = node.func
            if isinstance(fn, ast.Attribute) and fn.attr in ("get", "pop", "setdefault") and _is_environ(fn.value):
                keys.append(node.args[0])
            elif (isinstance(fn, ast.Attribute) and fn.attr == "getenv") or (isinstance(fn, ast.Name) and fn.id == "getenv"):
                keys.append(node.args[0])
        elif isinstance(node, ast.Subscript) and _is_environ(node.value):
            keys.append(node.slice)
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            keys.append(node.left)
    return keys


def _names_a_setting(key: ast.AST) -> bool:
    """A key that is (or is built from) a ``CHECKPOINTER_`` name, ``settings.X``, or an ``X_ENV`` constant."""
    for node in ast.walk(key):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("CHECKPOINTER_"):
            return True
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "settings":
            return True
        if isinstance(node, (ast.Name, ast.Attribute)) and getattr(node, "id", getattr(node, "attr", "")).endswith("_ENV"):
            return True
    return False


def setting_reads(source: str) -> list[str]:
    """Where a module reads a ``CHECKPOINTER_`` variable itself, or holds one's name as a string
    of its own (what a read would look it up by; a name inside longer text, a docstring or a
    message, is fine)."""
    found = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and VARIABLE.fullmatch(node.value):
            found.append(f"line {node.lineno}: the name {node.value!r}")
    for key in _env_keys(tree):
        if _names_a_setting(key):
            found.append(f"line {key.lineno}: reads {ast.unparse(key)} from the environment")
    return found


def package_files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", package_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_only_settings_reads_checkpointer_variables(path):
    if path == ROOT / "settings.py":
        return
    assert setting_reads(path.read_text()) == [], "read it through a getter of checkpointer/settings.py"


def test_every_variable_the_package_mentions_is_a_setting():
    mentioned = {name for path in package_files() for name in VARIABLE.findall(path.read_text())}
    assert mentioned and mentioned <= set(SETTINGS), mentioned - set(SETTINGS)


def _getter(name: str):
    return getattr(settings, name.removeprefix("CHECKPOINTER_").lower())


def test_every_getter_is_a_setting_and_every_setting_has_a_getter():
    getters = {
        name
        for name, fn in vars(settings).items()
        if inspect.isfunction(fn) and not name.startswith("_") and fn.__module__ == settings.__name__
    }
    assert getters == {name.removeprefix("CHECKPOINTER_").lower() for name in SETTINGS}
    for name in SETTINGS:
        doc = _getter(name).__doc__
        assert doc and "\n" not in doc.strip() and name in doc, name  # one line, naming its variable
        assert SETTINGS[name].meaning


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_getter_defaults_match_settings(name, monkeypatch):
    monkeypatch.delenv(name, raising=False)
    got = _getter(name)()
    default = SETTINGS[name].default
    assert got == default and type(got) is type(default)


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_getters_read_at_call_time(name, monkeypatch):
    value = {bool: "0", str: "google"}.get(type(SETTINGS[name].default), "3")
    if name == "CHECKPOINTER_DIRECT_IO":
        value = "0"
    monkeypatch.setenv(name, value)
    assert _getter(name)() != SETTINGS[name].default


@pytest.mark.parametrize("value, expected", [("0", False), ("off", False), (" No ", False), ("1", True), ("", True)])
def test_switches(value, expected, monkeypatch):
    monkeypatch.setenv("CHECKPOINTER_VERIFY_REPLICAS", value)
    monkeypatch.setenv("CHECKPOINTER_GCS_PARALLEL_UPLOAD", value)
    assert settings.verify_replicas() is settings.gcs_parallel_upload() is expected


@pytest.mark.parametrize(
    "value, expected",
    [("0", "never"), ("", "never"), (" 0 ", "never"), ("off", "never"), ("False", "never"), ("1", "always"),
     ("on", "always"), ("auto", "auto"), (" AUTO ", "auto"), (None, "auto")],
)
def test_direct_io_switch(value, expected, monkeypatch):
    if value is None:
        monkeypatch.delenv("CHECKPOINTER_DIRECT_IO", raising=False)
    else:
        monkeypatch.setenv("CHECKPOINTER_DIRECT_IO", value)
    assert settings.direct_io() == expected


def test_direct_io_refuses_an_unknown_value(monkeypatch):
    monkeypatch.setenv("CHECKPOINTER_DIRECT_IO", "sometimes")
    with pytest.raises(ValueError, match="CHECKPOINTER_DIRECT_IO='sometimes'"):
        settings.direct_io()


def test_io_retries_refuses_bad_values(monkeypatch):
    monkeypatch.setenv("CHECKPOINTER_IO_RETRIES", " ")
    assert settings.io_retries() == 8
    for bad in ("x", "-1", "1.5"):
        monkeypatch.setenv("CHECKPOINTER_IO_RETRIES", bad)
        with pytest.raises(ValueError, match="CHECKPOINTER_IO_RETRIES"):
            settings.io_retries()


@pytest.mark.parametrize(
    "name, bad",
    [("CHECKPOINTER_TIMEOUT_S", ["abc", "0", "-5", "nan"]), ("CHECKPOINTER_IO_THREADS", ["abc", "0", "2.5"]),
     ("CHECKPOINTER_STAGING_MIB", ["abc", "0", "nan"]), ("CHECKPOINTER_MAX_METADATA_MIB", ["abc", "-1"]),
     ("CHECKPOINTER_LOCK_LEASE_S", ["abc", "0"]), ("CHECKPOINTER_CRC32C", ["foo", "isal"]),
     ("CHECKPOINTER_VERIFY_REPLICAS", ["maybe", "2"]), ("CHECKPOINTER_GCS_PARALLEL_UPLOAD", ["sometimes"])],
)
def test_every_setting_refuses_what_it_cannot_mean_by_name(name, bad, monkeypatch):
    """An unparsable value was a bare ``int()``/``float()`` error naming no variable, an
    unknown CRC32C choice or switch value was taken for the default (found by a review)."""
    for value in bad:
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=f"^{name}="):
            _getter(name)()
    monkeypatch.setenv(name, " ")
    assert _getter(name)() == SETTINGS[name].default


def test_the_metadata_limit_documented_in_load_is_the_default():
    from checkpointer.engine.load import MAX_METADATA_BYTES

    assert SETTINGS["CHECKPOINTER_MAX_METADATA_MIB"].default * (1 << 20) == MAX_METADATA_BYTES


# ---------------------------------------------------------------------------------------------
# The checker itself can fail
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source",
    [
        'import os\nx = os.environ.get("CHECKPOINTER_IO_THREADS", "4")\n',
        'import os\nx = os.getenv("CHECKPOINTER_IO_THREADS")\n',
        'from os import environ\nx = environ["CHECKPOINTER_IO_THREADS"]\n',
        'import os\nx = "CHECKPOINTER_NEW" in os.environ\n',
        'NEW_ENV = "CHECKPOINTER_NEW"\n',
        'import os\nfrom . import settings\nx = os.environ.get(settings.IO_THREADS_ENV)\n',
        'import os\nx = os.environ.get(TIMEOUT_ENV, "300")\n',
        'import os\ndef f():\n    return os.environ.get(f"CHECKPOINTER_{1}")\n',
    ],
)
def test_checker_catches(source):
    assert setting_reads(source) != []


@pytest.mark.parametrize(
    "source",
    [
        '"""Bounded by ``CHECKPOINTER_TIMEOUT_S``."""\n',
        'raise ValueError("set CHECKPOINTER_MAX_METADATA_MIB to read more")\n',
        'import os\nx = os.environ.get("WORLD_SIZE", "1")\n',
        'from . import settings\nx = settings.io_threads()\nVERIFY_ENV = settings.VERIFY_REPLICAS_ENV\n',
        'import os\nx = tuple(os.environ.get(name) for name in ("AWS_PROFILE",))\n',
    ],
)
def test_checker_allows(source):
    assert setting_reads(source) == []
