"""The `strata` and `strata-coord` commands.

`strata up`             start the coordinator and every stage of a config as child processes
`strata coord`          the coordinator alone (what `strata-coord` runs)
`strata make-tiny-model build a random-weight checkpoint in the Hugging Face layout
`strata config check`   print the resolved config and the memory each stage will use
`strata keygen DIR`     make a box's keys (box key, CURVE keypairs) for box.curve_dir (pool/curve.py)
`strata bench ...`      benchmarks (see docs/BENCHMARKS.md)

The coordinator never imports the stage package: what needs torch (building the tiny model) runs in a
child Python process.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import subprocess
import sys
from pathlib import Path

from pool.config import Config, ConfigError, default_config_path, load_config
from pool.logs import event, setup_logging

log = logging.getLogger("strata.coord")


def resolve_model_dir(cfg: Config) -> Path:
    """The checkpoint directory (or .gguf file); `tiny` is built once into the cache (by a child process that
    has torch)."""
    if cfg.model != "tiny" and not cfg.model.startswith("tiny:"):
        path = Path(cfg.model).expanduser()
        if path.suffix == ".gguf":
            if not path.is_file():
                raise ConfigError(f"model: {cfg.model} is not a file")
            return path
        if not (path / "config.json").exists():
            raise ConfigError(f"model: {cfg.model} has no config.json")
        return path
    out = subprocess.run(
        [sys.executable, "-c", "import sys; from stages.tiny import ensure_tiny; print(ensure_tiny(sys.argv[1]))",
         cfg.model],
        check=True, capture_output=True, text=True,
    )
    return Path(out.stdout.strip().splitlines()[-1])


async def serve(cfg: Config) -> None:
    import uvicorn

    from .api import make_app
    from .http_limits import server_config
    from .link import StageLink
    from .scheduler import Scheduler
    from .tokenizer import Tokenizer

    model_dir = resolve_model_dir(cfg)
    tokenizer = Tokenizer.from_gguf(model_dir) if model_dir.suffix == ".gguf" else Tokenizer.from_dir(model_dir)
    if cfg.model == "tiny" or cfg.model.startswith("tiny:"):
        name = cfg.model
    else:
        name = model_dir.stem if model_dir.suffix == ".gguf" else model_dir.name
    link = StageLink(cfg)
    await link.start()
    scheduler = Scheduler(cfg, link, model_name=name, tokenizer=tokenizer)
    await scheduler.start()
    app = make_app(cfg, scheduler, tokenizer)
    c = cfg.coordinator
    server = uvicorn.Server(server_config(app, cfg, host=c.host, port=c.port, log_level="warning", loop="none",
                                          log_config=None))
    event(log, "coord.serving", url=f"http://{c.host}:{c.port}", model=name, stages=len(cfg.stages),
          pool_cells=scheduler.map.total_cells)
    try:
        await server.serve()
    finally:
        await scheduler.stop()
        link.close()


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="box YAML (default: the embedded cpu-tiny config)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set engine.kv_pool_tokens=8192")


def coord_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="strata-coord", description="Strata coordinator: HTTP API, scheduler, pool tables")
    _config_args(p)
    args = p.parse_args(argv)
    setup_logging("coord")
    try:
        cfg = load_config(args.config or default_config_path(), args.overrides)
    except ConfigError as err:
        print(f"strata-coord: {err}", file=sys.stderr)
        return 2
    try:
        import uvloop

        uvloop.run(serve(cfg))
    except ImportError:
        asyncio.run(serve(cfg))
    except KeyboardInterrupt:
        pass
    except Exception as err:  # noqa: BLE001 - a startup refusal must name its reason and exit non-zero
        print(f"strata-coord: {err}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="strata", description="Strata: an LLM serving engine with one shared KV pool")
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start the coordinator and all stages of a config")
    _config_args(up)
    sub.add_parser("coord", help="run the coordinator (same as strata-coord)", add_help=False)
    sub.add_parser("make-tiny-model", help="build a random-weight checkpoint (see --help)", add_help=False)
    cfgp = sub.add_parser("config", help="config tools")
    cfgsub = cfgp.add_subparsers(dest="config_cmd", required=True)
    cfgsub.add_parser("check", help="print the resolved config and its memory per stage", add_help=False)
    sub.add_parser("bench", help="benchmarks (see docs/BENCHMARKS.md)", add_help=False)
    kg = sub.add_parser("keygen", help="make a box's keys into a new directory (for box.curve_dir)")
    kg.add_argument("dir", help="a directory that does not exist yet (made 0700)")
    if argv and argv[0] in ("coord", "make-tiny-model", "bench"):
        cmd, rest = argv[0], argv[1:]
        if cmd == "coord":
            return coord_main(rest)
        if cmd == "make-tiny-model":
            return subprocess.call([sys.executable, "-m", "stages.tiny", *rest])
        from .bench import main as bench_main

        return bench_main(rest)
    if argv[:2] == ["config", "check"]:
        from .config_check import main_check

        return main_check(argv[2:])
    args = p.parse_args(argv)
    if args.cmd == "keygen":
        from pool.curve import keygen
        from pool.runtime import RuntimeDirError

        try:
            made = keygen(args.dir)
        except (FileExistsError, RuntimeDirError, OSError) as err:
            print(f"strata keygen: {err}", file=sys.stderr)
            return 1
        print(f"strata keygen: keys in {made}; set box.curve_dir: {made} on every host of the box "
              f"(copy the directory, keep it 0700)")
        return 0
    if args.cmd == "up":
        from .launch import up

        return up(args.config or str(default_config_path()), args.overrides)
    p.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
