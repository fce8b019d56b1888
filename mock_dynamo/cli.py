"""`mock-dynamo` command line."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from enum import StrEnum
from typing import Annotated

import typer

from mock_dynamo.config import DEFAULT_MODEL, MockConfig
from mock_dynamo.server import start_mock
from pylon.cli import PlainHelp

PROG = "mock-dynamo"
cli = typer.Typer(add_completion=False)


class FlavorName(StrEnum):
    dynamo = "dynamo"
    vllm = "vllm"
    sglang = "sglang"


class KvEncoding(StrEnum):
    array = "array"
    map = "map"


class LogLevel(StrEnum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


def _configure_logging(level: LogLevel) -> None:
    # stdout carries the port line a parent process parses; logs go to stderr.
    logging.basicConfig(
        stream=sys.stderr,
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


async def _serve(config: MockConfig, host: str, port: int) -> None:
    server = await start_mock(config, host=host, port=port)
    print(f"{PROG} listening on {server.base_url}", flush=True)
    if server.kv_events_endpoint is not None:
        print(f"{PROG} kv events on {server.kv_events_endpoint}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await server.stop()


def _run(config: MockConfig, host: str, port: int) -> None:
    try:
        import uvloop  # The daemon under test runs on uvloop; match it when available.
    except ImportError:
        asyncio.run(_serve(config, host, port))
    else:
        uvloop.run(_serve(config, host, port))


class MockHelp(PlainHelp):
    """pylon's plain help, each flag on a line of its own (typer's table cut the --tokenizer
    help and the --log-level choices at 80 columns), with the mock's own flag help."""

    settings_help = False


@cli.command(cls=MockHelp)
def serve(
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port; 0 picks a free one.")] = 8000,
    flavor: Annotated[
        FlavorName, typer.Option(help="Engine contract to enforce.")
    ] = FlavorName.dynamo,
    model: Annotated[list[str] | None, typer.Option(help="Served model name (repeatable).")] = None,
    ttft_ms: Annotated[float, typer.Option(min=0, help="Delay before the first token.")] = 0.0,
    token_delay_ms: Annotated[float, typer.Option(min=0, help="Delay between tokens.")] = 0.0,
    num_tokens: Annotated[int, typer.Option(min=0, help="Tokens per reply.")] = 16,
    capacity: Annotated[int, typer.Option(min=1, help="Recorded requests kept.")] = 1000,
    kv_block_size: Annotated[
        int, typer.Option(min=1, max=1024, help="Prefix-cache block size, in tokens.")
    ] = 16,
    kv_cache_blocks: Annotated[
        int, typer.Option(min=0, help="Prefix-cache capacity in blocks (LRU); 0: no cache.")
    ] = 0,
    prefill_tokens_per_s: Annotated[
        float,
        typer.Option(
            min=0, help="Prefill speed: TTFT = ttft-ms + uncached prompt tokens / rate; 0: free."
        ),
    ] = 0.0,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            help="Local HF model dir (tokenizer.json, tokenizer_config.json): tokenize prompts "
            "like the engine. Default: one token per word."
        ),
    ] = None,
    kv_events_port: Annotated[
        int | None,
        typer.Option(
            min=0,
            max=65535,
            help="Publish KV events (vLLM ZMQ wire format) on 127.0.0.1:PORT; 0 picks one. "
            "Needs --kv-cache-blocks.",
        ),
    ] = None,
    kv_events_encoding: Annotated[
        KvEncoding,
        typer.Option(help="KV events as vLLM's positional arrays or as maps (SGLang, Dynamo)."),
    ] = KvEncoding.array,
    log_level: Annotated[LogLevel, typer.Option(help="Log verbosity.")] = LogLevel.info,
) -> None:
    """Mock LLM engine that records what reached it."""
    config = MockConfig(
        flavor=flavor.value,
        models=tuple(model or (DEFAULT_MODEL,)),
        ttft_ms=ttft_ms,
        token_delay_ms=token_delay_ms,
        num_tokens=num_tokens,
        capacity=capacity,
        kv_block_size=kv_block_size,
        kv_cache_blocks=kv_cache_blocks,
        prefill_tokens_per_s=prefill_tokens_per_s,
        tokenizer=tokenizer,
        kv_events_port=kv_events_port,
        kv_events_encoding=kv_events_encoding.value,
    )
    _configure_logging(log_level)
    _run(config, host, port)


def _fail(message: str, code: int) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    """Entry point. Usage errors are one line on stderr (exit 2), so callers
    that launch this as a subprocess get a readable reason."""
    command = typer.main.get_command(cli)
    try:
        command.main(args=argv, prog_name=PROG, standalone_mode=False)
    except typer.TyperException as exc:
        # Typer vendors click; its usage errors all derive from TyperException.
        format_message = getattr(exc, "format_message", None)
        message = format_message() if callable(format_message) else str(exc)
        _fail(" ".join(str(message).split()), 2)
    except ValueError as exc:
        _fail(str(exc), 2)
    except OSError as exc:
        _fail(f"cannot listen: {exc}", 1)
    except (typer.Abort, KeyboardInterrupt):
        sys.exit(130)
