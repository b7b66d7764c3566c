"""The ``checkpointer`` command: inspect, verify, unshard, convert and prune checkpoints.

Every command prints a progress bar on a terminal for long work (nothing when the output is a
file or pipe, or with ``--quiet``) and, on failure, one line ``checkpointer: error: ...`` with
exit status 1. ``verify`` exits 1 with one line per problem. Usage errors exit 2.
Under ``torchrun``, ``unshard`` (and ``convert --to hf`` of a checkpoint) divide the output
shards among the processes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable, Sequence

from .errors import CheckpointError, CorruptCheckpointError
from .progress import Progress, format_bytes

__all__ = ["main", "build_parser"]

PROG = "checkpointer"
DEFAULT_SHARD_SIZE = "5GB"
_HF_ONLY = ("--dtype", "--max-shard-size")
_SIGPIPE_STATUS = 141  # 128 + SIGPIPE: how a shell tool ends when its reader has gone


class _StdoutClosed(Exception):
    """The reader of stdout went away (``checkpointer inspect DIR | head``)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect, verify, unshard, convert and prune checkpoints (local paths, file://, s3://, gs://).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    quiet = argparse.ArgumentParser(add_help=False)
    quiet.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no summary line")

    p = sub.add_parser("inspect", help="list every tensor: shape, dtype, sharding, bytes, files")
    p.add_argument("dir", metavar="DIR", help="a checkpoint directory, or one holding model/ and optim/")
    p.add_argument("--json", action="store_true", help="print the same information as JSON")

    p = sub.add_parser("verify", parents=[quiet], help="read every byte; check structure and checksums")
    p.add_argument("dir", metavar="DIR", help="a checkpoint directory, one holding model/ and optim/, or one of Hugging "
                   "Face safetensors (structure only: they hold no checksums)")

    p = sub.add_parser(
        "unshard", parents=[quiet], help="write the model as safetensors: one file, or HF-style shards + index"
    )
    p.add_argument("dir", metavar="DIR", help="a checkpoint directory, or one holding model/")
    p.add_argument("out", metavar="OUT", help="a .safetensors file, or a directory for shards and model.safetensors.index.json")
    _export_options(p)
    p.add_argument("--keys", metavar="REGEX", help="only tensors whose name matches REGEX (re.search)")

    p = sub.add_parser("convert", parents=[quiet], help="between checkpointer, torch DCP and Hugging Face formats, or to OLMo-core 0.1.0's")
    p.add_argument("src", metavar="SRC", help="the source; its format is detected")
    p.add_argument("dst", metavar="DST", help="where to write")
    p.add_argument("--to", required=True, choices=("checkpointer", "dcp", "hf", "olmo"),
                   help="the format to write (olmo: the verbose format 1 that ai2-olmo-core 0.1.0 reads)")
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="allow reading a torch DCP source: its .metadata is a Python pickle, which can run "
        "arbitrary code when read, so pass this only for checkpoints you trust",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a checkpoint already in DST (--to checkpointer, dcp or olmo; hf output, as unshard's, "
        "always replaces the files it writes)",
    )
    _export_options(p)

    p = sub.add_parser("prune", help="delete old checkpoints of a run directory, keeping the newest complete ones")
    p.add_argument("dir", metavar="RUN_DIR", help="a directory holding one sub-directory per checkpoint (step100, ...)")
    p.add_argument("--keep-last", type=int, required=True, metavar="N", help="keep the newest N complete checkpoints (the newest is always kept, even with 0)")
    p.add_argument("--keep-every", type=int, metavar="K", help="also keep every complete checkpoint whose step is a multiple of K")
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted; delete nothing")
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("checkpointer")
    except PackageNotFoundError:
        return "unknown"


def _export_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", metavar="DTYPE", help="cast floating-point tensors: bf16, fp16, fp32 (hf output)")
    p.add_argument(
        "--max-shard-size", metavar="SIZE", help=f"most bytes per output shard (default {DEFAULT_SHARD_SIZE}; hf output)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (``python -m checkpointer`` exits with it)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_usage(parser, args)
    joined = False
    try:
        joined = _init_distributed_from_env()
        return _COMMANDS[args.command](args)
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    except _StdoutClosed:
        # Not an error; stdout goes to /dev/null so that the flush at exit does not complain either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return _SIGPIPE_STATUS
    except (CheckpointError, OSError, ValueError, TypeError, KeyError) as ex:
        _error(_one_line(ex))
        return 1
    finally:
        if joined:
            from . import dist

            dist.leave_group()


def _check_usage(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Options that do not apply to the command as given are usage errors (exit 2), not ignored."""
    if args.command == "convert" and args.to != "hf":
        given = [flag for flag, value in zip(_HF_ONLY, (args.dtype, args.max_shard_size)) if value is not None]
        if given:
            _subcommand(parser, "convert").error(
                f"{' and '.join(given)} apply only to --to hf (Hugging Face safetensors output); "
                f"--to {args.to} writes every tensor in its own dtype, with no output shards"
            )


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of one subcommand: its usage errors show that command's usage line."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    return parser


def _shard_size(args: argparse.Namespace) -> str:
    return DEFAULT_SHARD_SIZE if args.max_shard_size is None else args.max_shard_size


def _one_line(ex: BaseException) -> str:
    text = " ".join(str(ex).split())
    if isinstance(ex, KeyError):
        text = f"no such key {text}"
    if isinstance(ex, OSError) and not isinstance(ex, FileExistsError) and ex.filename and str(ex.filename) not in text:
        text = f"{text}: {ex.filename}"
    return text or type(ex).__name__


def _out(text: str) -> None:
    """Output on stdout."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        raise _StdoutClosed from None


def _error(message: str) -> None:
    print(f"{PROG}: error: {_printable(message)}", file=sys.stderr, flush=True)


def _printable(text: str) -> str:
    """``text`` with each non-printable character escaped as ``repr`` would (``\\x1b``, ``\\n``,
    ``\\u202e``), the rest as is: names from a checkpoint are a stranger's text, and a terminal
    obeys the escape sequences and line breaks it is sent."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def _init_distributed_from_env() -> bool:
    """Under ``torchrun``, join its process group; returns whether this call created it."""
    from . import dist

    return dist.join_from_env()


def _rank() -> int:
    from . import dist

    return dist.get_rank()


def _progress(args: argparse.Namespace, desc: str, unit: str) -> Callable[[int, int], Progress] | None:
    if getattr(args, "quiet", False) or _rank() != 0:
        return None
    return lambda total_bytes, total_items: Progress(desc, total_bytes=total_bytes, total_items=total_items, unit=unit)


def _say(args: argparse.Namespace, text: str) -> None:
    if not getattr(args, "quiet", False) and _rank() == 0:
        _out(text)


# ---------------------------------------------------------------------------------------------
# inspect
# ---------------------------------------------------------------------------------------------


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .tools.summary import describe_parts

    parts = describe_parts(args.dir)
    if args.json:
        doc: Any = parts[0][1] if len(parts) == 1 and parts[0][0] == "" else {name: info for name, info in parts}
        _out(json.dumps(doc, indent=2))
    else:
        _out(render_table(parts))
    return 0


def render_table(parts: list[tuple[str, dict[str, Any]]]) -> str:
    """The human-readable form of :func:`~checkpointer.tools.summary.describe_parts`."""
    blocks = []
    for name, info in parts:
        head = _printable(f"{info['path']}") + (f" ({name})" if name else "")
        version = info["format_version"] if info["format_version"] is not None else "unknown (written by OLMo-core?)"
        world = info["world_size"] if info["world_size"] is not None else "unknown"
        rows = [("KEY", "SHAPE", "DTYPE", "SHARDING", "BYTES", "FILES")]
        for t in info["tensors"]:
            kind = "sharded" if t["is_sharded"] else "whole"
            pieces = f"{kind}, {t['pieces']} piece{'s' if t['pieces'] != 1 else ''}"
            rows.append(
                (_printable(t["key"]), str(t["shape"]), t["dtype"], pieces, format_bytes(t["bytes"]), _printable(_files_label(t["files"])))
            )
        for alias, target in sorted(info["aliases"].items()):
            rows.append((_printable(alias), "", "", f"tied to {_printable(target)}", "-", ""))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
        tied = f" (+{info['num_aliases']} tied)" if info["num_aliases"] else ""
        nfiles = len(info["files"])
        origin = ("Hugging Face safetensors" if info.get("format") == "hf"
                  else f"format version {version}, saved with world size {world}")
        lines.append(
            f"total: {info['num_tensors']} tensors{tied}, {format_bytes(info['total_bytes'])} "
            f"({info['total_bytes']} bytes) in {nfiles} file{'s' if nfiles != 1 else ''}; {origin}"
        )
        blocks.append("\n".join([f"checkpoint: {head}", *lines]))
    return "\n\n".join(blocks)


def _files_label(files: list[str]) -> str:
    """``rank_0.safetensors, rank_1..., rank_2...`` -> ``rank_[0-2]``."""
    from .format.layout import is_rank_filename

    ranks = sorted(int(f[len("rank_") : -len(".safetensors")]) for f in files if is_rank_filename(f))
    others = sorted(f for f in files if not is_rank_filename(f))
    spans: list[list[int]] = []
    for r in ranks:
        if spans and spans[-1][1] == r - 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    label = [] if not ranks else [f"rank_{text}" if len(ranks) == 1 else f"rank_[{text}]"]
    return ", ".join(label + others)


# ---------------------------------------------------------------------------------------------
# verify
# ---------------------------------------------------------------------------------------------


def _cmd_verify(args: argparse.Namespace) -> int:
    from .engine.locate import checkpoint_parts
    from .tools.verify import verify_checkpoint, verify_hf_checkpoint
    from .storage import open_storage

    problems: list[str] = []
    checked = []
    sums = ", checksums match"
    try:
        parts = checkpoint_parts(open_storage(args.dir), train=True)
    except CorruptCheckpointError as ex:
        parts, problems = [], [_one_line(ex)]
        hf_problems = verify_hf_checkpoint(args.dir)
        if hf_problems is not None:
            problems, sums = hf_problems, ""
            checked.append(f"{args.dir} (Hugging Face safetensors, which hold no checksums)")
    names = {name for name, _ in parts}
    if names and "" not in names and "optim" not in names:  # optim/ commits a step: its save died before it
        problems.append(f"{os.path.join(args.dir, 'optim', 'metadata.json')} is missing: {args.dir} is not a complete "
                        "checkpoint (its save never committed optim/, which ends it; loads and latest_checkpoint skip it)")
    for name, storage in parts:
        found = verify_checkpoint(storage, make_progress=_progress(args, f"verify {name or 'checkpoint'}", "chunks"))
        problems.extend(found)
        checked.append(storage.url)
    for line in problems:
        _out(_printable(line))
    if problems:
        _error(f"{len(problems)} problem{'s' if len(problems) != 1 else ''} found in {args.dir}")
        return 1
    _say(args, f"ok: {', '.join(checked)}: every tensor complete, every byte read{sums}")
    return 0


# ---------------------------------------------------------------------------------------------
# unshard, convert
# ---------------------------------------------------------------------------------------------


def _cmd_unshard(args: argparse.Namespace) -> int:
    from .tools.export import export_checkpoint

    files = export_checkpoint(
        args.dir,
        args.out,
        max_shard_size=_shard_size(args),
        dtype=args.dtype,
        keys=args.keys,
        make_progress=_progress(args, "unshard", "tensors"),
    )
    _say(args, _wrote(files, args.out))
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from .tools.convert import convert

    def note(text: str) -> None:
        print(f"{PROG}: note: {text}", file=sys.stderr, flush=True)

    try:
        files = convert(
            args.src,
            args.dst,
            to=args.to,
            allow_pickle=args.allow_pickle,
            max_shard_size=_shard_size(args),
            dtype=args.dtype,
            save_overwrite=args.overwrite,
            make_progress=_progress(args, f"convert to {args.to}", "files" if args.to == "olmo" else "tensors"),
            notes=note,
        )
    except FileExistsError as ex:
        raise FileExistsError(overwrite_for_command_line(str(ex))) from ex
    _say(args, _wrote(files, args.dst))
    return 0


def _cmd_prune(args: argparse.Namespace) -> int:
    from .api import prune
    from .storage import open_storage
    from .tools.retention import check_run_directory, plan_prune

    run_dir = args.dir.rstrip("/") or "/"
    check_run_directory(open_storage(run_dir))
    if args.dry_run:
        names = plan_prune(open_storage(run_dir), args.keep_last, args.keep_every) if _rank() == 0 else []
        for name in names:
            _out(_printable(f"would delete {run_dir}/{name}"))
        return 0
    for path in prune(run_dir, keep_last=args.keep_last, keep_every=args.keep_every):
        if _rank() == 0:
            _out(_printable(f"deleted {path}"))
    return 0


def overwrite_for_command_line(message: str) -> str:
    """The library's ``FileExistsError`` text, which tells a Python caller to pass
    ``save_overwrite=True``, told the command line's way: ``--overwrite``."""
    text = message.replace("save_overwrite=True", "--overwrite")
    return text if "--overwrite" in text else f"{text} (pass --overwrite to replace it)"


def _wrote(files: list[str], out: str) -> str:
    """``wrote 3 files (1.2 GiB) to OUT``; the size only where every file is local."""
    from .storage.urls import is_url

    size: int | None = 0
    for f in files:
        try:
            size = None if size is None or is_url(f) else size + os.path.getsize(f)
        except OSError:
            size = None
    who = "" if _world() == 1 else "rank 0 "
    count = f"{len(files)} file{'s' if len(files) != 1 else ''}"
    return f"{who}wrote {count}{'' if size is None else f' ({format_bytes(size)})'} to {out}"


def _world() -> int:
    from . import dist

    return dist.get_world_size()


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "inspect": _cmd_inspect,
    "verify": _cmd_verify,
    "unshard": _cmd_unshard,
    "convert": _cmd_convert,
    "prune": _cmd_prune,
}
