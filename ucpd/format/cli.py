"""``ucpd ls``, ``ucpd inspect`` and ``ucpd convert`` (registered by ``ucpd/cli.py``)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import FormatError, VersionNotFound
from . import spec

FROM = ("deepspeed", "deepspeed-ucp", "dcp", "torch", "universal")
TO = ("universal", "dcp", "safetensors", "hf", "deepspeed-ucp")


def add_commands(sub: Any) -> None:
    p = sub.add_parser("ls", help="list the versions of a universal checkpoint root",
                       description="List the step-<N> versions under DIR: state, tensors, bytes, time, LATEST.")
    p.add_argument("dir", metavar="DIR", help="checkpoint root (holds step-<N>/ folders), or its URL (s3://bucket/prefix)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("inspect", help="show the tensors, layout and objects of one version",
                       description="Show one version of DIR (default: LATEST).")
    p.add_argument("dir", metavar="DIR", help="checkpoint root, or one step-<N> folder, or a URL of either (s3://...)")
    p.add_argument("--step", type=int, default=None, help="version to show (default: LATEST)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--verify", action="store_true", help="also validate the version (all checksums)")
    p.add_argument("--spec", metavar="FILE_OR_NAME", help="show which rule of this UCL spec each tensor followed")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="bind a spec symbol (repeatable)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("convert", help="import or export checkpoints (via the universal format)",
                       description="Convert SRC to DST. Imports write a version step-<N> under the root DST; "
                       "exports read a version of the root SRC (default: LATEST).")
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST")
    p.add_argument("--from", dest="src_format", choices=FROM, required=True)
    p.add_argument("--to", dest="dst_format", choices=TO, required=True)
    p.add_argument("--step", type=int, default=None,
                   help="imports: step to record (default: from the source, else 0); exports: version to read")
    p.add_argument("--shard-size", default=None, help="target size of each safetensors shard, e.g. 1G, 512M")
    p.add_argument("--unsafe-pickle", action="store_true",
                   help="let torch.load unpickle arbitrary objects (only for files you trust; DeepSpeed's own "
                   "files are read safely without it)")
    p.add_argument("--hf-config", default=None, metavar="FILE",
                   help="--to hf: copy this config.json beside the shards (from_pretrained needs one)")
    p.add_argument("--strip-prefix", default="", metavar="PREFIX",
                   help="exports (hf, deepspeed-ucp): drop PREFIX from parameter names, e.g. 'model.'")
    p.set_defaults(func=cmd_convert)


# --------------------------------------------------------------------------------------------


def _console() -> Any:
    from rich.console import Console

    tty = sys.stdout.isatty()
    return Console(file=sys.stdout, width=None if tty else 200, no_color=not tty, highlight=False)


def human(n: int | None) -> str:
    if n is None:
        return "-"
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if x < 1024 or unit == "TiB":
            return f"{int(x)} B" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{n} B"  # pragma: no cover


def when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def cmd_ls(args: argparse.Namespace) -> int:
    from .roots import as_root

    root = as_root(args.dir)
    if not root.exists():
        raise FormatError(f"{root.name}: no such directory, bucket or prefix")
    versions = root.list_versions()
    if args.json:
        print(json.dumps([v.to_dict() for v in versions], indent=1))
        return 0
    if not versions:
        jobs = root.children()
        if jobs:  # a daemon's --flush-dir: one checkpoint root per job
            _console().print(f"{root.name}: the flush dir of jobs {', '.join(jobs)}; list one with "
                             f"`ucpd ls {root.join(jobs[0]).name}`")
        else:
            _console().print(f"{root.name}: no versions")
        return 0
    _print_versions(root.name, versions)
    return 0


def _print_versions(title: str, versions) -> None:
    from rich.table import Table

    con = _console()
    table = Table(title=title, title_justify="left")
    for col, j in (("step", "right"), ("state", "left"), ("tensors", "right"), ("size", "right"),
                   ("created", "left"), ("", "left")):
        table.add_column(col, justify=j)
    for v in versions:
        state = v.state if v.state == "complete" else f"{v.state}: {v.problem}"
        table.add_row(str(v.step), state, str(v.tensors) if v.state == "complete" else "-",
                      human(v.nbytes) if v.state == "complete" else "-", when(v.created),
                      "LATEST" if v.latest else "")
    con.print(table)


def _resolve_version_dir(d: str, step: int | None):
    """Accept a root or a ``step-<N>`` folder holding no versions of its own, or a URL of either
    (then ``--step`` must agree): (the root, the step)."""
    from .roots import as_root

    root = as_root(d)
    parent, _, last = str(d).rstrip("/").rpartition("/")
    s = spec.parse_step_dirname(last)
    if s is None or root.list_versions():
        return root, step
    if step is not None and step != s:
        raise VersionNotFound(f"{d} is step {s}, but --step {step} was asked")
    return as_root(parent or "."), s


def cmd_inspect(args: argparse.Namespace) -> int:
    root, step = _resolve_version_dir(args.dir, args.step)
    # a store's version is fetched into a temporary folder; checked below only with --verify, as a folder is
    with root.open_version(step, verify=False) as r:
        m = r.meta
        blobs = {"global": None if m.objects_global is None else m.objects_global.nbytes,
                 "ranks": {str(k): b.nbytes for k, b in sorted(m.objects_ranks.items())}}
        problems = None
        shown = root.where(r.step)
        if args.verify:
            from .roots import as_root

            with progress_bar("verify") as progress:  # the reader's copy, named as the root names it
                local = str(r.path.parent)
                problems = [p.replace(local, root.name) for p in as_root(local).validate(r.step, True, progress)]
        explained = _explain(r, args) if args.spec else None
        if args.json:
            out = {
                "path": shown, "step": r.step, "format_version": m.format_version,
                "created": m.created, "chunk_bytes": m.chunk_bytes, "total_bytes": m.total_bytes,
                "layout": m.layout,
                "files": {f.name: {"size": f.size, "data_offset": f.data_offset} for f in m.files.values()},
                "tensors": [
                    {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "pattern": t.pattern,
                     "file": t.file, "byte_range": [t.data_offset, t.data_offset + t.nbytes], "nbytes": t.nbytes}
                    for t in r.tensors.values()
                ],
                "objects": blobs,
            }
            if problems is not None:
                out["problems"] = problems
            if explained is not None:
                out["spec"] = explained.to_json()
            print(json.dumps(out, indent=1))
            return 1 if problems or (explained is not None and not explained.ok) else 0
        from rich.table import Table

        con = _console()
        con.print(f"[bold]{shown}[/bold]  step {r.step}  format v{m.format_version}  created {m.created}")
        con.print(f"{len(r.tensors)} tensors, {human(m.total_bytes)} in {len(m.files)} files, "
                  f"crc32c per {human(m.chunk_bytes)} chunk")
        lay = json.dumps(m.layout, separators=(",", ":"))
        con.print(f"layout: {lay if len(lay) <= 300 else lay[:297] + '...'}", markup=False)
        ranks = blobs["ranks"]
        con.print(
            f"objects: global {human(blobs['global'])}; {len(ranks)} ranks"
            + (f", {human(sum(ranks.values()))} in all" if ranks else ""), markup=False
        )
        table = Table(show_edge=False)
        for col, j in (("name", "left"), ("dtype", "left"), ("shape", "left"), ("pattern", "left"),
                       ("file", "left"), ("size", "right")):
            table.add_column(col, justify=j, overflow="fold")
        for t in r.tensors.values():
            table.add_row(t.name, t.dtype, "[" + ", ".join(map(str, t.shape)) + "]", spec.pattern_text(t.pattern),
                          t.file, human(t.nbytes))
        con.print(table)
        if problems is not None:
            if problems:
                con.print(f"[red]{len(problems)} problems:[/red]")
                for p in problems:
                    con.print("  " + p, markup=False)
            else:
                con.print("verified: no problems")
        if explained is not None:
            con.print(explained.format(), markup=False)
        return 1 if problems or (explained is not None and not explained.ok) else 0


def _explain(reader, args: argparse.Namespace):
    """Which rule of the spec each tensor of the version followed (``inspect --spec``)."""
    from ..ucl.spec.explain import bind_for_cli, explain

    spec, symbols = bind_for_cli(args.spec, args.set)  # a SpecError says line:column; exit 2
    return explain(reader, spec, symbols)


@contextmanager
def progress_bar(desc: str) -> Iterator[Any]:
    """A tqdm byte counter on stderr when it is a terminal; yields a progress(done, total)."""
    from tqdm import tqdm

    bar = tqdm(desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not sys.stderr.isatty(),
               file=sys.stderr, leave=False)

    def progress(done: int, total: int) -> None:
        if bar.total != total:
            bar.total = total
        bar.update(done - bar.n)

    try:
        yield progress
    finally:
        bar.close()


def cmd_convert(args: argparse.Namespace) -> int:
    from ..knobs import parse_size
    from .convert import CONVERTERS

    key = (args.src_format, args.dst_format)
    fn = CONVERTERS.get(key)
    if fn is None:
        raise FormatError(
            f"cannot convert {args.src_format} -> {args.dst_format} directly; supported: "
            + ", ".join(f"{a}->{b}" for a, b in CONVERTERS)
            + " (convert to universal first)"
        )
    kw: dict[str, Any] = {"step": args.step}
    if args.dst_format == "universal":
        kw["shard_bytes"] = parse_size(args.shard_size) if args.shard_size else None
    elif args.dst_format == "hf" and args.shard_size:
        kw["shard_bytes"] = parse_size(args.shard_size)
    elif args.shard_size:
        raise FormatError("--shard-size applies only to --to universal and --to hf")
    if args.hf_config:
        if args.dst_format != "hf":
            raise FormatError("--hf-config applies only to --to hf")
        kw["config"] = args.hf_config
    if args.strip_prefix:
        if args.dst_format not in ("hf", "deepspeed-ucp"):
            raise FormatError("--strip-prefix applies only to --to hf and --to deepspeed-ucp")
        kw["strip_prefix"] = args.strip_prefix
    if args.unsafe_pickle:
        if args.src_format not in ("torch", "deepspeed", "deepspeed-ucp"):
            raise FormatError("--unsafe-pickle applies only to --from torch, deepspeed and deepspeed-ucp")
        kw["unsafe_pickle"] = True
    t0 = time.perf_counter()
    with progress_bar(f"{args.src_format} -> {args.dst_format}") as progress:
        out = fn(args.src, args.dst, progress=progress, **kw)
    print(f"wrote {out} ({args.src_format} -> {args.dst_format}) in {time.perf_counter() - t0:.1f} s")
    return 0
