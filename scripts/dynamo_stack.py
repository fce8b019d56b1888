#!/usr/bin/env python3
"""A real NVIDIA Dynamo 1.6.1 stack on loopback, for end-to-end tests of pylon.

What it starts (all on 127.0.0.1, nothing else is opened):

* a tiny ZMQ XSUB/XPUB forwarder (pyzmq) that Dynamo's event plane publishes KV events
  through (``DYN_ZMQ_BROKER_URL``), so no publisher binds ``0.0.0.0``;
* ``python -m dynamo.frontend`` with the KV router and router queueing on
  (``--router-queue-threshold``);
* N (default 2) ``python -m dynamo.mocker`` workers, each with a fixed TCP request-plane port.

Discovery is file based in a private state dir; ``TMPDIR`` and ``HOME`` point inside it, so nothing
is written elsewhere.  The model is a tiny offline model dir (config.json + a BPE tokenizer trained
locally with ``tokenizers`` + a ChatML chat template); nothing is downloaded.

Use from Python::

    with DynamoStack(speedup_ratio=1.0) as stack:
        stack.frontend_url        # http://127.0.0.1:PORT
        stack.worker_ids          # [id of worker 0, id of worker 1] (decimal instance ids)
        stack.worker_log(0)       # worker 0's log, ANSI colours stripped

or by hand: ``python scripts/dynamo_stack.py`` (runs until Ctrl-C, printing the URLs).

Every process is started in its own process group and is stopped (SIGTERM, then SIGKILL, bounded
waits) on exit, including when start-up fails. docs/dynamo.md ("Running the stack by hand")
says why each step is needed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODEL_NAME = "tiny"
BLOCK_SIZE = 16

_ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

# The XSUB/XPUB forwarder.  Dynamo 1.6.1 ships no broker binary; publishers connect to the XSUB
# side, subscribers to the XPUB side.
BROKER_SRC = r"""
import signal, sys, zmq
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
ctx = zmq.Context()
xsub = ctx.socket(zmq.XSUB); xsub.bind("tcp://127.0.0.1:%s" % sys.argv[1])
xpub = ctx.socket(zmq.XPUB); xpub.bind("tcp://127.0.0.1:%s" % sys.argv[2])
print("broker up", sys.argv[1], sys.argv[2], flush=True)
try:
    zmq.proxy(xsub, xpub)
except (KeyboardInterrupt, zmq.ContextTerminated):
    pass
"""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def strip_ansi(text: str) -> str:
    return _ANSI_RE.sub("", text)


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 (racy by nature, good enough for tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _training_corpus(max_files: int = 60) -> list[str]:
    """Local text to train the tokenizer on: a fixed, sorted slice of the stdlib sources."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())[:max_files]
    texts = []
    for p in files:
        with contextlib.suppress(OSError, UnicodeDecodeError):
            texts.append(p.read_text(encoding="utf-8"))
    texts.append("Hello world. The quick brown fox jumps over the lazy dog. " * 20)
    return texts


def build_model_dir(path: str | Path, vocab_size: int = 4096) -> Path:
    """Write a tiny, weightless, offline model dir (config + locally trained tokenizer).

    Idempotent: if ``path`` already holds a complete model dir it is reused.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(path)
    marker = out / ".complete"
    if marker.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    real_vocab = tok.get_vocab_size()

    def dump(name: str, obj: dict[str, Any]) -> None:
        (out / name).write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")

    dump(
        "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "<|im_end|>",
            "unk_token": "<unk>",
            "pad_token": "</s>",
            "model_max_length": 8192,
            "add_bos_token": False,
            "add_eos_token": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    dump(
        "special_tokens_map.json",
        {
            "bos_token": "<s>",
            "eos_token": "<|im_end|>",
            "unk_token": "<unk>",
            "pad_token": "</s>",
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        },
    )
    dump(
        "config.json",
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "vocab_size": real_vocab,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "torch_dtype": "bfloat16",
            "bos_token_id": 1,
            "eos_token_id": [2, 4],
            "tie_word_embeddings": True,
        },
    )
    dump(
        "generation_config.json",
        {"bos_token_id": 1, "eos_token_id": [2, 4], "max_new_tokens": 256},
    )
    marker.write_text("ok\n")
    return out


class StackError(RuntimeError):
    """The stack failed to start (the message carries the relevant log tails)."""


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    log_file: Any = field(repr=False)


@dataclass
class DynamoStack:
    """Broker + frontend (KV router, queueing on) + mocker workers, all on 127.0.0.1.

    ``router_mode="direct"`` makes the frontend route only by the worker pin a request carries
    (``x-dynamo-worker-instance-id``); an unpinned request then gets 400.

    Ports left as ``None`` are picked free at start.  ``speedup_ratio`` 1.0 simulates realistic
    GPU timing, 10 is fast, 0 means no simulated delay.
    """

    num_workers: int = 2
    speedup_ratio: float = 10.0
    router_mode: str = "kv"  # the frontend's --router-mode: kv, round-robin, random, direct
    router_queue_threshold: float | None = 0.0
    http_port: int | None = None
    worker_ports: list[int] | None = None
    broker_ports: tuple[int, int] | None = None
    state_dir: str | Path | None = None
    model_dir: str | Path | None = None
    python: str = sys.executable
    startup_timeout_s: float = 60.0
    stop_timeout_s: float = 5.0
    extra_frontend_args: list[str] = field(default_factory=list)
    extra_mocker_args: list[str] = field(default_factory=list)
    # Per worker (one entry per worker, appended after extra_mocker_args), e.g. a speedup ratio
    # that differs per worker.
    per_worker_mocker_args: list[list[str]] | None = None
    # One ZMQ KV-event PUB port per worker (mocker `--zmq-kv-events-ports <port>`).  The mocker
    # binds these on ALL interfaces (no flag changes that): run the stack inside a private
    # network namespace (`unshare --net`, then `ip link set lo up`) when you set them.
    kv_event_ports: list[int] | None = None
    num_gpu_blocks: int | None = None  # mocker --num-gpu-blocks-override (its KV cache size)
    model_name: str = MODEL_NAME  # the served model name (--model-name)
    dyn_log: str | None = None

    # Filled in by start().
    frontend_url: str = field(init=False, default="")
    worker_ids: list[int] = field(init=False, default_factory=list)
    _procs: list[_Proc] = field(init=False, default_factory=list)
    _own_state_dir: bool = field(init=False, default=False)

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> DynamoStack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> DynamoStack:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        if self.state_dir is None:
            self.state_dir = tempfile.mkdtemp(prefix="dynamo-stack-")
            self._own_state_dir = True
        self.state = Path(self.state_dir).resolve()
        self.state.mkdir(parents=True, exist_ok=True)
        self.log_dir = self.state / "logs"
        self.kv_dir = self.state / "kv"
        for d in (self.log_dir, self.state / "tmp", self.state / "home"):
            d.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.kv_dir, ignore_errors=True)
        self.kv_dir.mkdir()

        self.model_path = build_model_dir(self.model_dir or self.state / "model")
        self.http_port = self.http_port or free_port()
        if self.worker_ports is None:
            self.worker_ports = [free_port() for _ in range(self.num_workers)]
        if len(self.worker_ports) != self.num_workers:
            raise ValueError("worker_ports must have num_workers entries")
        for name in ("per_worker_mocker_args", "kv_event_ports"):
            value = getattr(self, name)
            if value is not None and len(value) != self.num_workers:
                raise ValueError(f"{name} must have num_workers entries")
        self.broker_ports = self.broker_ports or (free_port(), free_port())
        self.frontend_url = f"http://127.0.0.1:{self.http_port}"
        env = self._env()

        self._spawn("broker", [self.python, "-c", BROKER_SRC, *map(str, self.broker_ports)], env)
        frontend_cmd = [
            self.python,
            "-m",
            "dynamo.frontend",
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(self.http_port),
            "--router-mode",
            self.router_mode,
            "--discovery-backend",
            "file",
            "--request-plane",
            "tcp",
            "--event-plane",
            "zmq",
        ]
        if self.router_queue_threshold is not None:
            frontend_cmd += ["--router-queue-threshold", str(self.router_queue_threshold)]
        self._spawn("frontend", frontend_cmd + list(self.extra_frontend_args), env)
        for i, port in enumerate(self.worker_ports):
            cmd = [
                self.python,
                "-m",
                "dynamo.mocker",
                "--model-path",
                str(self.model_path),
                "--model-name",
                self.model_name,
                "--block-size",
                str(BLOCK_SIZE),
                "--speedup-ratio",
                str(self.speedup_ratio),
                "--discovery-backend",
                "file",
                "--request-plane",
                "tcp",
                "--event-plane",
                "zmq",
                *self.extra_mocker_args,
            ]
            if self.num_gpu_blocks is not None:
                cmd += ["--num-gpu-blocks-override", str(self.num_gpu_blocks)]
            if self.kv_event_ports is not None:
                cmd += ["--zmq-kv-events-ports", str(self.kv_event_ports[i])]
            if self.per_worker_mocker_args is not None:
                cmd += self.per_worker_mocker_args[i]
            self._spawn(f"worker{i}", cmd, {**env, "DYN_TCP_RPC_PORT": str(port)})
        self._wait_ready()

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        for k in list(env):  # never inherit someone else's Dynamo wiring
            if k.startswith(("DYN_", "NATS_", "ETCD_")):
                del env[k]
        xsub, xpub = self.broker_ports  # type: ignore[misc]
        env.update(
            {
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "DYN_DISCOVERY_BACKEND": "file",
                "DYN_FILE_KV": str(self.kv_dir),
                "DYN_REQUEST_PLANE": "tcp",
                "DYN_EVENT_PLANE": "zmq",
                "DYN_TCP_RPC_HOST": "127.0.0.1",
                "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
                "DYN_EVENT_PLANE_HOST": "127.0.0.1",
                "DYN_ZMQ_BROKER_URL": f"xsub=tcp://127.0.0.1:{xsub} , xpub=tcp://127.0.0.1:{xpub}",
                "DYN_SELF_HOST_METADATA": "0",
                "TMPDIR": str(self.state / "tmp"),
                "HOME": str(self.state / "home"),
                "PYTHONUNBUFFERED": "1",
            }
        )
        if self.dyn_log:
            env["DYN_LOG"] = self.dyn_log
        return env

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        log_path = self.log_dir / f"{name}.log"
        log_file = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        popen = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(self.state),
            start_new_session=True,  # own process group, so stop() can kill the whole tree
        )
        self._procs.append(_Proc(name, popen, log_path, log_file))

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        last_err = "no answer yet"
        while time.monotonic() < deadline:
            for p in self._procs:
                if p.popen.poll() is not None:
                    raise StackError(
                        f"{p.name} exited with {p.popen.returncode} during start-up\n"
                        + self._log_tails()
                    )
            try:
                health = self.health()
                ids = self._worker_ids_from_health(health)
                if ids is not None and self._models_listed():
                    self.worker_ids = ids
                    return
                last_err = f"health: {json.dumps(health)[:500]}"
            except (OSError, urllib.error.URLError, ValueError) as e:
                last_err = repr(e)
            time.sleep(0.2)
        raise StackError(
            f"stack not ready within {self.startup_timeout_s}s ({last_err})\n" + self._log_tails()
        )

    def _worker_ids_from_health(self, health: dict[str, Any]) -> list[int] | None:
        assert self.worker_ports is not None
        return worker_ids_from_health(health, self.worker_ports)

    def _models_listed(self) -> bool:
        body = self.get_json("/v1/models")
        return any(m.get("id") == self.model_name for m in body.get("data") or [])

    def worker_index(self, instance_id: int) -> int:
        """Which worker (index into worker_ports / kv_event_ports / worker_log) an instance id
        is; ValueError for an id this stack did not start."""
        return self.worker_ids.index(int(instance_id))

    def kv_events_endpoint(self, index: int) -> str:
        """Worker `index`'s KV-event PUB as seen from inside its network namespace."""
        if self.kv_event_ports is None:
            raise ValueError("the stack was started without kv_event_ports")
        return f"tcp://127.0.0.1:{self.kv_event_ports[index]}"

    def stop(self) -> None:
        """Stop every process this stack started (SIGTERM to the group, then SIGKILL)."""
        procs, self._procs = self._procs, []
        for p in procs:
            _signal_group(p.popen, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        for p in procs:
            # SIGKILL the group even if the leader exited: children may linger.
            _signal_group(p.popen, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=self.stop_timeout_s)
            with contextlib.suppress(OSError):
                p.log_file.close()
        if self._own_state_dir and self.state_dir and not os.environ.get("DYNAMO_STACK_KEEP"):
            shutil.rmtree(self.state_dir, ignore_errors=True)

    def signal_worker(self, index: int, sig: int = signal.SIGTERM) -> None:
        """Send `sig` to worker `index`'s process group (SIGTERM: it deregisters in ~0.2 s,
        and the frontend's /health stops listing its instance)."""
        worker = next(p for p in self._procs if p.name == f"worker{index}")
        _signal_group(worker.popen, sig)

    # ------------------------------------------------------------------ helpers
    def get_json(self, path: str, timeout: float = 5.0) -> Any:
        with urllib.request.urlopen(self.frontend_url + path, timeout=timeout) as r:
            return json.loads(r.read())

    def health(self) -> dict[str, Any]:
        try:
            return self.get_json("/health")  # type: ignore[no-any-return]
        except urllib.error.HTTPError as e:  # 503 while not healthy still has a JSON body
            return json.loads(e.read() or b"{}")  # type: ignore[no-any-return]

    def metrics(self) -> str:
        with urllib.request.urlopen(self.frontend_url + "/metrics", timeout=5.0) as r:
            data: bytes = r.read()
        return data.decode()

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def log(self, name: str) -> str:
        try:
            return strip_ansi(self.log_path(name).read_text(errors="replace"))
        except FileNotFoundError:
            return ""

    def worker_log(self, index: int) -> str:
        return self.log(f"worker{index}")

    def frontend_log(self) -> str:
        return self.log("frontend")

    def _log_tails(self, lines: int = 25) -> str:
        out = []
        for p in self._procs:
            tail = self.log(p.name).splitlines()[-lines:]
            out.append(f"--- {p.name} ({p.log_path}) ---\n" + "\n".join(tail))
        return "\n".join(out)

    def describe(self) -> str:
        lines = [
            f"frontend   {self.frontend_url}  (OpenAI API, /health, /metrics)",
            f"model      {self.model_name}  ({self.model_path})",
        ]
        assert self.worker_ports is not None
        for i, (port, wid) in enumerate(zip(self.worker_ports, self.worker_ids, strict=True)):
            lines.append(f"worker{i}    instance_id={wid}  request plane tcp://127.0.0.1:{port}")
        assert self.broker_ports is not None
        lines.append(
            f"broker     xsub tcp://127.0.0.1:{self.broker_ports[0]}  "
            f"xpub tcp://127.0.0.1:{self.broker_ports[1]}"
        )
        lines.append(f"state dir  {self.state}  (logs in {self.log_dir})")
        return "\n".join(lines)


_TCP_RE = re.compile(r"^127\.0\.0\.1:(\d+)(?:/|$)")


def worker_ids_from_health(health: dict[str, Any], worker_ports: list[int]) -> list[int] | None:
    """The `generate` instance id of each request-plane port in `worker_ports`, in that order,
    from the frontend's `GET /health` body (`instances[]`, each with `instance_id` and
    `transport.tcp` = `127.0.0.1:<DYN_TCP_RPC_PORT>/...`); None while any port is not listed.
    """
    by_port: dict[int, int] = {}
    for inst in health.get("instances") or []:
        if not isinstance(inst, dict) or inst.get("endpoint") != "generate":
            continue
        transport = inst.get("transport")
        tcp = transport.get("tcp") if isinstance(transport, dict) else None
        m = _TCP_RE.match(tcp) if isinstance(tcp, str) else None
        if m and "instance_id" in inst:
            by_port[int(m.group(1))] = int(inst["instance_id"])
    if all(p in by_port for p in worker_ports):
        return [by_port[p] for p in worker_ports]
    return None


def _signal_group(popen: subprocess.Popen[bytes], sig: int) -> None:
    # start_new_session=True made the child a group leader, so its pgid == its pid.  Signal by
    # that id only (never by name), and never our own group.
    if popen.pid <= 0 or popen.pid == os.getpgrp():
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, sig)


def build_parser() -> argparse.ArgumentParser:
    """The command line (also read by tests/unit/test_container_files.py)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--http-port", type=int, default=8787)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument(
        "--worker-port-base", type=int, default=27001, help="worker i uses base+i (request plane)"
    )
    ap.add_argument("--broker-ports", type=int, nargs=2, default=(25555, 25556))
    ap.add_argument("--speedup-ratio", type=float, default=1.0)
    ap.add_argument(
        "--router-queue-threshold", type=float, default=0.0, help="negative disables queueing"
    )
    ap.add_argument("--state-dir", default=None, help="default: a fresh temp dir (removed at exit)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    stack = DynamoStack(
        num_workers=args.workers,
        speedup_ratio=args.speedup_ratio,
        router_queue_threshold=None
        if args.router_queue_threshold < 0
        else args.router_queue_threshold,
        http_port=args.http_port,
        worker_ports=[args.worker_port_base + i for i in range(args.workers)],
        broker_ports=tuple(args.broker_ports),
        state_dir=args.state_dir,
    )
    stop = {"flag": False}

    def on_term(*_: object) -> None:
        stop["flag"] = True

    signal.signal(signal.SIGTERM, on_term)
    with stack:
        print(stack.describe(), flush=True)
        print(
            f"\ntry: curl -s {stack.frontend_url}/v1/chat/completions -H 'content-type: "
            'application/json\' -d \'{"model":"tiny","messages":[{"role":"user",'
            '"content":"Hello"}],"max_tokens":5}\'\nCtrl-C to stop.',
            flush=True,
        )
        try:
            while not stop["flag"]:
                for p in stack._procs:
                    if p.popen.poll() is not None:
                        print(f"{p.name} exited with {p.popen.returncode}; stopping", flush=True)
                        return 1
                time.sleep(0.5)
        except KeyboardInterrupt:
            print("\nstopping", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
