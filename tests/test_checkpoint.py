"""Checkpoint formats: HF save/load with transformers parity, mamba_ssm layout, lossless conversion, bad input."""
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from mamba_draft import MambaConfig, MambaDrafter, convert
from mamba_draft.commands.cli import main as cli
from tests.helpers.drafters import save_tiny_hf_mamba, tiny_hf_mamba

IDS = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]])


def write_mamba_ssm_checkpoint(directory, arch="mamba1", real_vocab=90, multiple=8):
    """What MambaLMHeadModel.save_pretrained writes: mamba_ssm config + pytorch_model.bin, padded vocab."""
    padded = real_vocab + (-real_vocab) % multiple
    hf = tiny_hf_mamba(arch, vocab_size=padded)
    state = {k.replace("backbone.embeddings.", "backbone.embedding."): v for k, v in hf.state_dict().items()}
    c = hf.config
    ssm_cfg = {"layer": "Mamba1" if arch == "mamba1" else "Mamba2", "d_state": c.state_size, "d_conv": c.conv_kernel,
               "expand": c.expand}
    if arch == "mamba2":
        ssm_cfg.update(headdim=c.head_dim, ngroups=c.n_groups, chunk_size=c.chunk_size)
    config = {"d_model": c.hidden_size, "d_intermediate": 0, "n_layer": c.num_hidden_layers, "vocab_size": real_vocab,
              "ssm_cfg": ssm_cfg, "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True, "residual_in_fp32": True,
              "fused_add_norm": True, "pad_vocab_size_multiple": multiple,
              "tie_embeddings": bool(c.tie_word_embeddings)}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    torch.save(state, directory / "pytorch_model.bin")
    return hf


@pytest.mark.parametrize("arch", ["mamba1", "mamba2"])
def test_save_pretrained_loads_in_transformers(arch, tmp_path):
    hf = tiny_hf_mamba(arch)
    hf.save_pretrained(tmp_path / "src")
    drafter = MambaDrafter.from_pretrained(tmp_path / "src")
    drafter.save_pretrained(tmp_path / "ours")
    cls = transformers.MambaForCausalLM if arch == "mamba1" else transformers.Mamba2ForCausalLM
    reloaded = cls.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(IDS).logits, hf(IDS).logits)
    assert torch.equal(MambaDrafter.from_pretrained(tmp_path / "ours").forward(IDS), drafter.forward(IDS))


@pytest.mark.parametrize("arch", ["mamba1", "mamba2"])
def test_mamba_ssm_checkpoint_loads_with_padded_vocab(arch, tmp_path):
    hf = write_mamba_ssm_checkpoint(tmp_path / "ssm", arch)
    drafter = MambaDrafter.from_pretrained(tmp_path / "ssm")
    assert drafter.vocab_size == 90 and drafter.config.vocab_size == 96
    with torch.no_grad():
        torch.testing.assert_close(drafter.forward(IDS), hf(IDS).logits[..., :90], atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["mamba1", "mamba2"])
def test_round_trip_is_bit_identical(arch, tmp_path):
    write_mamba_ssm_checkpoint(tmp_path / "ssm", arch)
    original = torch.load(tmp_path / "ssm" / "pytorch_model.bin", weights_only=True)
    convert(tmp_path / "ssm", tmp_path / "hf", to="hf")
    convert(tmp_path / "hf", tmp_path / "ssm2", to="mamba_ssm")
    convert(tmp_path / "ssm2", tmp_path / "hf2", to="hf")
    back = torch.load(tmp_path / "ssm2" / "pytorch_model.bin", weights_only=True)
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], original[k]) for k in original)
    # same model description (ours spells out mamba_ssm's defaults, e.g. dt_rank and bias)
    assert MambaConfig.from_mamba_ssm_dict(json.loads((tmp_path / "ssm2" / "config.json").read_text())) == \
        MambaConfig.from_mamba_ssm_dict(json.loads((tmp_path / "ssm" / "config.json").read_text()))
    hf1, hf2 = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "hf2" / "model.safetensors")
    assert hf1.keys() == hf2.keys() and all(torch.equal(hf1[k], hf2[k]) for k in hf1)
    logits = [MambaDrafter.from_pretrained(tmp_path / d).forward(IDS) for d in ("ssm", "hf", "ssm2", "hf2")]
    assert all(torch.equal(logits[0], other) for other in logits[1:])
    # the converted HF directory is a normal transformers checkpoint
    cls = transformers.MambaForCausalLM if arch == "mamba1" else transformers.Mamba2ForCausalLM
    with torch.no_grad():
        torch.testing.assert_close(cls.from_pretrained(tmp_path / "hf").eval()(IDS).logits[..., :90], logits[0],
                                   atol=1e-5, rtol=0)


def test_bf16_checkpoint_round_trip_keeps_dtype(tmp_path):
    hf = tiny_hf_mamba("mamba1").to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "a")
    convert(tmp_path / "a", tmp_path / "b", to="mamba_ssm")
    convert(tmp_path / "b", tmp_path / "c", to="hf")
    a, c = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "c" / "model.safetensors")
    assert all(c[k].dtype == torch.bfloat16 and torch.equal(a[k], c[k]) for k in a)


def test_convert_cli(tmp_path, capsys):
    save_tiny_hf_mamba(tmp_path / "hf", "mamba2")
    assert cli(["convert", "--from", "hf", "--to", "mamba_ssm", str(tmp_path / "hf"), str(tmp_path / "ssm")]) == 0
    assert "wrote mamba_ssm checkpoint" in capsys.readouterr().out
    assert (tmp_path / "ssm" / "pytorch_model.bin").is_file()
    assert cli(["convert", "--from", "mamba_ssm", "--to", "hf", str(tmp_path / "ssm"), str(tmp_path / "back")]) == 0
    assert torch.equal(MambaDrafter.from_pretrained(tmp_path / "back").forward(IDS),
                       MambaDrafter.from_pretrained(tmp_path / "hf").forward(IDS))
    with pytest.raises(SystemExit, match="is a hf checkpoint, not mamba_ssm"):
        cli(["convert", "--from", "mamba_ssm", "--to", "hf", str(tmp_path / "hf"), str(tmp_path / "x")])
    with pytest.raises(FileExistsError, match="not empty"):
        cli(["convert", "--to", "hf", str(tmp_path / "ssm"), str(tmp_path / "back")])


def test_bad_checkpoints(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        MambaDrafter.from_pretrained(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        MambaDrafter.from_pretrained(tmp_path / "empty")

    good = save_tiny_hf_mamba(tmp_path / "good")
    config = json.loads((good / "config.json").read_text())

    def variant(name, config_update=None, weights=None):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**config, **(config_update or {})}))
        if weights is not None:
            (d / "model.safetensors").write_bytes(weights)
        return d

    weights = (good / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="unknown architecture.*'llama'"):
        MambaDrafter.from_pretrained(variant("llama", {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
                                             weights))
    with pytest.raises(FileNotFoundError, match="no weights"):
        MambaDrafter.from_pretrained(variant("noweights"))
    with pytest.raises(ValueError, match="corrupt"):
        MambaDrafter.from_pretrained(variant("corrupt", weights=weights[: len(weights) // 2]))
    with pytest.raises(ValueError, match="shape mismatch.*in_proj"):
        MambaDrafter.from_pretrained(variant("shape", {"hidden_size": 48}, weights))
    with pytest.raises(ValueError, match="missing"):
        MambaDrafter.from_pretrained(variant("layers", {"num_hidden_layers": 3}, weights))
    (tmp_path / "badjson").mkdir()
    (tmp_path / "badjson" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        MambaDrafter.from_pretrained(tmp_path / "badjson")
    # a corrupt pickle in mamba_ssm format is refused without unpickling arbitrary objects
    write_mamba_ssm_checkpoint(tmp_path / "ssm")
    (tmp_path / "ssm" / "pytorch_model.bin").write_bytes(b"\x80\x04garbage")
    with pytest.raises(ValueError, match="corrupt"):
        MambaDrafter.from_pretrained(tmp_path / "ssm")
    # nothing half-written when conversion fails
    with pytest.raises(ValueError):
        convert(tmp_path / "shape", tmp_path / "out", to="mamba_ssm")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def test_hub_id_resolves_through_huggingface_hub(tmp_path, monkeypatch):
    """A non-local `org/name` goes through huggingface_hub.snapshot_download (stubbed here: tests never download)."""
    import huggingface_hub

    local = save_tiny_hf_mamba(tmp_path / "snapshot", "mamba2")
    calls = []

    def fake_snapshot_download(repo_id, revision=None, allow_patterns=None):
        calls.append((repo_id, revision, allow_patterns))
        return str(local)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    drafter = MambaDrafter.from_pretrained("state-spaces/tiny-test", revision="main")
    assert calls[0][:2] == ("state-spaces/tiny-test", "main")
    assert "config.json" in calls[0][2] and "*.safetensors" in calls[0][2]
    assert drafter.config.arch == "mamba2"

    def offline(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(FileNotFoundError, match="neither a local directory nor a downloadable hub repository"):
        MambaDrafter.from_pretrained("org/missing-model")


def test_cli_lists_commands_and_rejects_unknown(capsys):
    assert cli(["--help"]) == 0
    out = capsys.readouterr().out
    assert "convert" in out and "generate" in out and "export" in out
    assert cli(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err
