"""Bad input gets a one-line error and the right exit code (1 runtime, 2 usage), never a traceback."""

from __future__ import annotations

import struct
import sys

import pytest
from gguf import GGUFWriter

from spec_cli.cli import main
from spec_cli.model.loader import layer_devices


def cli(capsys, monkeypatch, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["spec-cli", *args])
    with pytest.raises(SystemExit) as exc:
        main()
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def assert_one_line_error(code: int, err: str, expected_code: int, *needles: str) -> None:
    assert code == expected_code, err
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert lines and any(all(n in line for n in needles) for line in lines), err


def write_gguf_with_unknown_type(path) -> None:
    """A minimal GGUF by hand: one kv (general.architecture = llama), one tensor of GGML type id 99."""

    def s(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()

    header = b"GGUF" + struct.pack("<IQQ", 3, 1, 1)
    kv = s("general.architecture") + struct.pack("<I", 8) + s("llama")
    info = s("token_embd.weight") + struct.pack("<I", 2) + struct.pack("<QQ", 32, 4) + struct.pack("<IQ", 99, 0)
    body = header + kv + info
    path.write_bytes(body + b"\0" * (-len(body) % 32) + b"\0" * 4096)


def test_not_a_gguf(capsys, monkeypatch, tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_text("hello, I am not a model")
    assert_one_line_error(*cli(capsys, monkeypatch, "run", "-m", str(bogus), "-p", "hi")[::2], 1, "not a GGUF")


def test_truncated_gguf(capsys, monkeypatch, tmp_path, tiny_model_path):
    cut = tmp_path / "cut.gguf"
    data = tiny_model_path.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    assert_one_line_error(*cli(capsys, monkeypatch, "run", "-m", str(cut), "-p", "hi")[::2], 1, "truncated")
    cut.write_bytes(data[:100])
    assert_one_line_error(*cli(capsys, monkeypatch, "run", "-m", str(cut), "-p", "hi")[::2], 1, "truncated")


def shrink_tensor(src, dst, name: str) -> None:
    """A copy of a GGUF whose header gives tensor `name` one row fewer (ne1 - 1) than its data holds."""
    data = bytearray(src.read_bytes())
    key = struct.pack("<Q", len(name)) + name.encode()
    at = data.index(key) + len(key) + 4 + 8  # past the name, n_dims (u32) and ne0 (u64)
    (ne1,) = struct.unpack_from("<Q", data, at)
    struct.pack_into("<Q", data, at, ne1 - 1)
    dst.write_bytes(bytes(data))


@pytest.mark.parametrize("last", [False, True])
def test_tensor_shape_that_disagrees_with_its_data(capsys, monkeypatch, tmp_path, tiny_model_path, last):
    from spec_cli.model.gguf_file import GGUFFile

    name = list(GGUFFile(tiny_model_path).tensors)[-1] if last else "blk.0.attn_q.weight"
    shrunk = tmp_path / "shrunk.gguf"
    shrink_tensor(tiny_model_path, shrunk, name)
    # the header check names the file and the tensor, before any tensor data is read
    needle = f"the last tensor {name} (F32, shape" if last else f"tensor {name} (F32, shape (63, 64)) takes"
    assert_one_line_error(*cli(capsys, monkeypatch, "run", "-m", str(shrunk), "-p", "hi")[::2], 1, "shrunk.gguf",
                          needle, "header is wrong")


def test_unknown_architecture(capsys, monkeypatch, tmp_path):
    path = tmp_path / "mamba.gguf"
    w = GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_one_line_error(*cli(capsys, monkeypatch, "run", "-m", str(path), "-p", "hi")[::2], 1,
                          "unsupported architecture 'mamba'")


def test_unknown_block_type(capsys, monkeypatch, tmp_path):
    path = tmp_path / "weird.gguf"
    write_gguf_with_unknown_type(path)
    assert_one_line_error(*cli(capsys, monkeypatch, "run", "-m", str(path), "-p", "hi")[::2], 1, "unknown GGML type")


def test_missing_tokenizer(capsys, monkeypatch, tmp_path):
    from tests.tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "notok.gguf", with_tokenizer=False)
    assert_one_line_error(*cli(capsys, monkeypatch, "run", "-m", str(path), "-p", "hi")[::2], 1, "tokenizer")


def test_prompt_longer_than_context(capsys, monkeypatch, tiny_model_path):
    code, _, err = cli(capsys, monkeypatch, "run", "-m", str(tiny_model_path), "-p", "word " * 200, "-c", "64", "-n", "4")
    assert_one_line_error(code, err, 1, "prompt is too long")


def test_unknown_model_name(capsys, monkeypatch):
    code, _, err = cli(capsys, monkeypatch, "run", "-m", "llama-9000", "-p", "hi")
    assert_one_line_error(code, err, 1, "unknown model 'llama-9000'", "smollm2-135m")


@pytest.mark.parametrize("args, needle", [
    (["--temp", "abc"], "temp"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--spec-type", "ngram-bogus"], "--spec-type must be drafter types from"),
    (["--draft-p-min", "2"], "--draft-p-min"),
    (["--draft-p-min", "sometimes"], "--draft-p-min must be a probability in [0, 1] or auto"),
    (["--draft-vocab", "-1"], "--draft-vocab"),
    (["--spec-verify", "maybe"], "--spec-verify"),
    (["-c", "-5"], "-c"),
    (["--dtype", "int3"], "--dtype"),
    (["--spec-type", "draft-simple"], "draft model"),
    (["--no-such-flag"], "No such option"),
])
def test_bad_flag_values_are_usage_errors(capsys, monkeypatch, tiny_model_path, args, needle):
    code, _, err = cli(capsys, monkeypatch, "run", "-m", str(tiny_model_path), "-p", "hi", "-n", "2", *args)
    assert_one_line_error(code, err, 2, needle)


def test_server_refuses_an_empty_api_key(capsys, monkeypatch, tiny_model_path):
    # an empty key would turn authentication off without a word
    code, _, err = cli(capsys, monkeypatch, "server", "-m", str(tiny_model_path), "--api-key", "")
    assert_one_line_error(code, err, 2, "--api-key must be a key of printable characters")


def test_a_draft_vocabulary_sharing_too_little(capsys, monkeypatch, tmp_path, tiny_model_path):
    from tests.tiny_gguf import write_tiny_gguf

    other = write_tiny_gguf(tmp_path / "othervocab.gguf", vocab_changes={"tokenizer.ggml.pre": "default",
                                                                          "rename_tokens": range(5, 300)})
    code, _, err = cli(capsys, monkeypatch, "speculative-simple", "-m", str(tiny_model_path), "-md", str(other),
                       "-p", "hi", "-n", "2")
    assert_one_line_error(code, err, 1, "not the target's (token 5 differs", "too few", "9 of its 304")


def test_ngl_offloads_the_last_layers_like_llamacpp():
    import torch

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert layer_devices(4, cpu, 2) == ([cpu] * 4, cpu)  # no GPU: -ngl is ignored
    assert layer_devices(4, cuda, -1) == ([cuda] * 4, cuda)
    assert layer_devices(4, cuda, 2) == ([cpu, cpu, cuda, cuda], cpu)
    assert layer_devices(4, cuda, 5) == ([cuda] * 4, cuda)  # n_layer + 1 also moves the output layer
    assert layer_devices(4, cuda, 0) == ([cpu] * 4, cpu)
