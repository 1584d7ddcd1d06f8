"""Tiny reward models in the real on-disk formats, built once per session into a temporary folder.

- an open_clip model config JSON (ViT: 32 px, patch 8, width 64, 2 layers; text: width 64, 2 layers, the real
  49,408-token vocabulary, context 77; 32-d embeddings) and a checkpoint of it (a plain state dict);
- an HPS checkpoint: the same architecture, other weights, saved as ``{"state_dict": ...}`` like HPS_v2*.pt;
- an aesthetic MLP state dict with the LAION key layout (``layers.0/2/4/6/7``) on 32-d embeddings;
- a transformers ``CLIPModel`` folder and a ``CLIPProcessor`` folder (``CLIPTokenizer`` made from open_clip's BPE
  vocabulary file, ``model_max_length`` 77; ``CLIPImageProcessor`` at 32 px).

Building everything takes about 2 s on 2 cores.
"""

from __future__ import annotations

import gzip
import itertools
import json
import os
import sys
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

TINY_CLIP_CFG = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "head_width": 32, "patch_size": 8},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}


@dataclass(frozen=True)
class TinyModels:
    """Paths of the tiny models (see the module notes)."""

    clip_config: str  # open_clip model-config JSON; its stem is the model name
    clip_checkpoint: str  # plain open_clip state dict
    hps_checkpoint: str  # {"state_dict": open_clip state dict}
    aesthetic_checkpoint: str  # LAION-layout MLP state dict, 32-d input
    pick_model: str  # transformers CLIPModel folder
    pick_processor: str  # transformers CLIPProcessor folder

    @property
    def clip_name(self) -> str:
        return Path(self.clip_config).stem


def _tiny_open_clip_state(seed: int) -> dict[str, torch.Tensor]:
    import open_clip

    torch.manual_seed(seed)
    model = open_clip.create_model("mmgrpo_tiny_clip")
    return model.state_dict()


def _clip_tokenizer_files(folder: Path) -> None:
    """open_clip's ``bpe_simple_vocab_16e6.txt.gz`` as ``vocab.json`` + ``merges.txt`` (the 49,408-token CLIP BPE)."""
    from open_clip.tokenizer import bytes_to_unicode, default_bpe

    with gzip.open(default_bpe(), "rt", encoding="utf-8") as f:
        merges = [tuple(line.split()) for line in f.read().split("\n")[1:49152 - 256 - 2 + 1]]
    symbols = list(bytes_to_unicode().values())
    vocab = symbols + [s + "</w>" for s in symbols] + ["".join(m) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    assert len(vocab) == 49408
    (folder / "vocab.json").write_text(json.dumps({tok: i for i, tok in enumerate(vocab)}), encoding="utf-8")
    lines = ["#version: 0.2"] + [" ".join(m) for m in merges]
    (folder / "merges.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")


def _build_pickscore(root: Path) -> tuple[str, str]:
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    torch.manual_seed(2)
    config = CLIPConfig(
        text_config={"vocab_size": 49408, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "max_position_embeddings": 77, "bos_token_id": 49406,
                     "eos_token_id": 49407, "pad_token_id": 49407},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": 32, "patch_size": 8},
        projection_dim=16,
    )
    model_dir, proc_dir = root / "pickscore_model", root / "pickscore_processor"
    CLIPModel(config).save_pretrained(model_dir)
    proc_dir.mkdir()
    _clip_tokenizer_files(proc_dir)
    tokenizer = CLIPTokenizer(vocab=str(proc_dir / "vocab.json"), merges=str(proc_dir / "merges.txt"),
                              model_max_length=77)
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(proc_dir)
    return str(model_dir), str(proc_dir)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    import open_clip

    root = tmp_path_factory.mktemp("tiny_reward_models")
    config = root / "mmgrpo_tiny_clip.json"
    config.write_text(json.dumps(TINY_CLIP_CFG), encoding="utf-8")
    open_clip.add_model_config(config)
    clip_ckpt, hps_ckpt, mlp_ckpt = root / "tiny_clip.pt", root / "HPS_tiny.pt", root / "aesthetic_tiny.pth"
    torch.save(_tiny_open_clip_state(0), clip_ckpt)
    torch.save({"state_dict": _tiny_open_clip_state(1)}, hps_ckpt)
    torch.manual_seed(3)
    sizes = [32, 1024, 128, 64, 16, 1]
    mlp = {}
    for index, (fan_in, fan_out) in zip([0, 2, 4, 6, 7], itertools.pairwise(sizes)):
        mlp[f"layers.{index}.weight"] = torch.randn(fan_out, fan_in) / fan_in ** 0.5
        mlp[f"layers.{index}.bias"] = torch.randn(fan_out) * 0.1
    mlp["layers.7.bias"] = torch.tensor([5.0])
    torch.save(mlp, mlp_ckpt)
    pick_model, pick_processor = _build_pickscore(root)
    return TinyModels(str(config), str(clip_ckpt), str(hps_ckpt), str(mlp_ckpt), pick_model, pick_processor)


_WRITES: list[str] | None = None  # file opens for writing, recorded while a `no_file_writes` block is active
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _audit(event: str, args: tuple) -> None:
    if _WRITES is None or event != "open":
        return
    path, mode, flags = (tuple(args) + (None, None, None))[:3]
    writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
        isinstance(flags, int) and bool(flags & _WRITE_FLAGS))
    if writing:
        _WRITES.append(str(path))


_AUDIT_INSTALLED = False


class _WriteRecorder:
    """Context manager: ``with no_file_writes as writes: ...`` records every file opened for writing."""

    def __enter__(self) -> list[str]:
        global _WRITES
        _WRITES = []
        return _WRITES

    def __exit__(self, *exc: object) -> None:
        global _WRITES
        _WRITES = None


@pytest.fixture
def no_file_writes(monkeypatch: pytest.MonkeyPatch) -> _WriteRecorder:
    """A recorder of file writes: Python-level opens for writing (``open``, ``os.open``: PIL, numpy, tempfile...)
    through an audit hook, plus ``torch.save``, whose C++ writer opens files without an audit event."""
    global _AUDIT_INSTALLED
    if not _AUDIT_INSTALLED:
        sys.addaudithook(_audit)  # audit hooks cannot be removed; this one is idle outside a recorder block
        _AUDIT_INSTALLED = True
    original = torch.save

    def recording_save(obj, f, *args, **kwargs):
        if _WRITES is not None:
            _WRITES.append(f"torch.save -> {f}")
        return original(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", recording_save)
    monkeypatch.setattr(torch.serialization, "save", recording_save)
    return _WriteRecorder()


@pytest.fixture
def serve():
    """``serve(handler_class)`` -> the base URL of a loopback ThreadingHTTPServer running it; each one started is
    stopped when the test ends."""
    servers = []

    def start(handler: type[BaseHTTPRequestHandler]) -> str:
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
        thread.start()
        servers.append((httpd, thread))
        return f"http://127.0.0.1:{httpd.server_address[1]}"

    yield start
    for httpd, thread in servers:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


@pytest.fixture
def canned_server(serve):
    """A stand-in reward server on loopback for replies the real one never sends: ``/health`` is right,
    ``/v1/score`` answers ``reply["score"]``; ``reply["auth"]`` collects the Authorization headers received."""
    reply = {}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, obj):
            body = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            reply.setdefault("auth", []).append(self.headers.get("Authorization"))
            self._send({"status": "ok", "wire_version": 2})

        def do_POST(self):
            reply.setdefault("auth", []).append(self.headers.get("Authorization"))
            self.rfile.read(int(self.headers["Content-Length"]))
            self._send(reply["score"])

    return serve(Handler), reply
