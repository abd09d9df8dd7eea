"""GGUF files as models (speculative/models/gguf.py): tiny Llama GGUF files written here with gguf's own
writer, as llama.cpp's converter writes them, and read back through transformers."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from conftest import noisy_copy, tiny_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerFast

from speculative import LLM, SamplingParams, SpeculativeConfig, cli
from speculative.models import loading
from speculative.models.gguf import gguf_dtype, gguf_source, load_gguf, save_checkpoint
from speculative.models.llama import NativeCausalLM
from speculative.models.loading import load_model

MERGES = [("h", "e"), ("Ġ", "t"), ("Ġt", "he"), ("a", "t"), ("Ġ", "c"), ("Ġc", "at")]
EOS = "<|endoftext|>"
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
PROMPT = "the cat sat on the mat"
QUANTIZED = gguf.GGMLQuantizationType.Q8_0


def byte_bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with merges: the 256 byte tokens, one token per merge (MERGES), then
    <|endoftext|> (id 262) as BOS, EOS and padding."""
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for left, right in MERGES:
        vocab[left + right] = len(vocab)
    vocab[EOS] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, bos_token=EOS, pad_token=EOS)


def write_gguf(path: Path, model: PreTrainedModel, tokenizer, qtype=gguf.GGMLQuantizationType.F32) -> None:
    """`model` (a tiny Llama) and `tokenizer` as llama.cpp's converter writes them: llama.cpp's metadata
    keys and tensor names, Q and K rows permuted to llama.cpp's RoPE layout, norms in F32 and every
    other tensor in `qtype` (F32, F16 or a quantized type), no output.weight for tied embeddings."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    tokens = [token for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token == EOS else 1 for token in tokens])  # 3: control
    writer.add_token_merges([f"{left} {right}" for left, right in MERGES])
    for add, token in (
        (writer.add_bos_token_id, EOS),
        (writer.add_eos_token_id, EOS),
        (writer.add_pad_token_id, EOS),
    ):
        add(tokenizer.convert_tokens_to_ids(token))
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, tensor in llama_cpp_tensors(model).items():
        data = tensor.numpy()
        if data.ndim == 1:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llama_cpp_tensors(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The model's weights under llama.cpp's names, Q and K permuted as its converter does."""
    config, state = model.config, model.state_dict()
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    tensors = {
        "token_embd.weight": state["model.embed_tokens.weight"],
        "output_norm.weight": state["model.norm.weight"],
    }
    if not config.tie_word_embeddings:
        tensors["output.weight"] = state["lm_head.weight"]
    names = {
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_norm": "post_attention_layernorm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    for layer in range(config.num_hidden_layers):
        for ours, theirs in names.items():
            weight = state[f"model.layers.{layer}.{theirs}.weight"]
            if ours in ("attn_q", "attn_k"):
                weight = permute(weight, heads if ours == "attn_q" else kv_heads)
            tensors[f"blk.{layer}.{ours}.weight"] = weight
    return tensors


def permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf permutation of a Q or K projection's rows (its rotary layout)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def as_stored(model: PreTrainedModel, qtype) -> PreTrainedModel:
    """A copy of `model` whose matrices went through `qtype` and back: the weights the file holds."""
    stored = noisy_copy(model, 0.0)
    with torch.no_grad():
        for parameter in stored.parameters():
            if parameter.dim() == 2:
                blocks = gguf.quants.quantize(parameter.numpy(), qtype)
                parameter.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, qtype)))
    return stored


@dataclass
class Files:
    """The GGUF files of the tests and the transformers models holding the weights each file stores."""

    target: str  # F32, untied embeddings
    draft: str  # Q8_0 of a noisy copy of the target
    tied: str  # F16, tied embeddings
    target_model: PreTrainedModel
    draft_model: PreTrainedModel  # as stored: Q8_0 and back
    tokenizer: PreTrainedTokenizerFast


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Files:
    root = tmp_path_factory.mktemp("gguf")
    tokenizer = byte_bpe_tokenizer()
    eos = tokenizer.eos_token_id
    target = tiny_model(
        "llama", vocab_size=len(tokenizer), eos_token_id=eos, bos_token_id=eos, pad_token_id=eos
    )
    draft = noisy_copy(target, 0.02)
    tied = tiny_model("llama", vocab_size=len(tokenizer), seed=3, tie_word_embeddings=True, eos_token_id=eos)
    paths = {name: root / f"{name}.gguf" for name in ("target", "draft", "tied")}
    write_gguf(paths["target"], target, tokenizer)
    write_gguf(paths["draft"], draft, tokenizer, QUANTIZED)
    write_gguf(paths["tied"], tied, tokenizer, gguf.GGMLQuantizationType.F16)
    return Files(*(str(p) for p in paths.values()), target, as_stored(draft, QUANTIZED), tokenizer)


def greedy(model: PreTrainedModel, ids: list[int], n: int) -> list[int]:
    """n tokens of `model`'s greedy continuation of `ids`, a full forward each."""
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.mark.parametrize("which", ["target", "draft"])
def test_a_gguf_runs_natively_as_the_model_it_was_written_from(files, which) -> None:
    """F32 and Q8_0 (dequantized): the text of the file's tokenizer and the greedy tokens of the
    model whose weights the file stores, on the native forward."""
    path, model = (
        (files.target, files.target_model) if which == "target" else (files.draft, files.draft_model)
    )
    llm = LLM(path, dtype="float32")
    assert isinstance(llm.target.model, NativeCausalLM)
    assert llm.target.name == path
    assert llm.target.eos_token_ids == [files.tokenizer.eos_token_id]
    ids = llm.tokenizer.encode(PROMPT)
    assert ids == files.tokenizer.encode(PROMPT)  # the merges apply: fewer ids than bytes
    assert len(ids) < len(PROMPT)
    out = llm.generate([ids], GREEDY)[0].outputs[0]
    assert list(out.token_ids) == greedy(model, ids, 16)


@pytest.mark.parametrize("native", [True, False])
def test_auto_dequantizes_a_quantized_file_to_bfloat16_where_the_cpu_computes_it(files, native, monkeypatch):
    """dtype "auto" of a Q8_0 file: bfloat16 on a CPU with native bfloat16 (AVX512-BF16, AMX), float32
    on one without; the reason says which. An F32 file stays float32 either way."""
    monkeypatch.setattr(loading, "cpu_computes_natively", lambda dtype: native)
    choice = load_model(files.draft).dtype
    assert choice.dtype == (torch.bfloat16 if native else torch.float32)
    assert (
        "quantized GGUF" in choice.reason
        and ("natively" if native else "no native bfloat16") in choice.reason
    )
    assert load_model(files.target).dtype.dtype == torch.float32


def test_b_speculating_with_gguf_target_and_draft_gives_the_targets_greedy_output(files) -> None:
    llm = LLM(
        files.target,
        draft_model=files.draft,
        speculative_config=SpeculativeConfig(method="draft_model", num_speculative_tokens=3),
        dtype="float32",
    )
    assert isinstance(llm.draft.model, NativeCausalLM)
    ids = files.tokenizer.encode(PROMPT)
    output = llm.generate([ids], GREEDY)[0]
    assert list(output.outputs[0].token_ids) == greedy(files.target_model, ids, 16)
    assert output.metrics.num_accepted > 0  # the noisy copy agrees with its target


def test_c_save_checkpoint_writes_a_folder_from_pretrained_loads(files, tmp_path) -> None:
    """F16 with tied embeddings -> a float32 Hugging Face folder: same logits, tokenizer, chat template
    and special ids as the file, no quantization_config, and no temporary folder left."""
    assert gguf_dtype(files.tied) == torch.float16
    model, tokenizer = load_gguf(files.tied, torch.float32)
    generation = model.generation_config
    eos = files.tokenizer.eos_token_id
    assert (generation.eos_token_id, generation.bos_token_id, generation.pad_token_id) == (eos, eos, eos)
    out = tmp_path / "cache" / "tied"
    save_checkpoint(files.tied, out)
    assert sorted(p.name for p in out.parent.iterdir()) == ["tied"]
    saved = AutoModelForCausalLM.from_pretrained(out)
    saved_tokenizer = AutoTokenizer.from_pretrained(out)
    assert not hasattr(saved.config, "quantization_config")
    assert saved.config.tie_word_embeddings and saved.dtype == torch.float32
    assert saved.generation_config.eos_token_id == eos
    assert saved_tokenizer.chat_template == tokenizer.chat_template == CHAT_TEMPLATE
    ids = saved_tokenizer.encode(PROMPT)
    assert ids == tokenizer.encode(PROMPT) == files.tokenizer.encode(PROMPT)
    with torch.no_grad():
        torch.testing.assert_close(saved(torch.tensor([ids])).logits, model(torch.tensor([ids])).logits)
    with pytest.raises(FileExistsError, match=r"out_dir .* exists and is not an empty folder"):
        save_checkpoint(files.tied, out)


def test_c_an_interrupted_save_checkpoint_leaves_no_folder(files, tmp_path, monkeypatch) -> None:
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(files.tied, tmp_path / "tied")
    assert list(tmp_path.iterdir()) == []


def test_d_cli_takes_a_folder_holding_one_gguf_and_a_gguf_draft(files, tmp_path, capsys) -> None:
    folder = tmp_path / "target"
    folder.mkdir()
    shutil.copy(files.target, folder)
    argv = ["generate", "--model", str(folder), "--draft-model", files.draft, "--prompt", PROMPT, "--no-chat"]
    assert cli.main(argv + ["--max-tokens", "8", "--dtype", "float32"]) == 0
    stdout = capsys.readouterr().out
    assert stdout.startswith(PROMPT)
    assert "[draft_model, k=4] " in stdout


def test_gguf_source(files, tmp_path) -> None:
    """What names a GGUF file: a .gguf file, a folder with one and no config.json; not a Hugging Face
    folder or a hub id; an error for a missing .gguf or a folder with several."""
    target = Path(files.target)
    assert gguf_source(str(target)) == (str(target.parent), target.name)
    assert gguf_source("org/model") is None
    with pytest.raises(FileNotFoundError, match="no GGUF file at"):
        gguf_source(str(tmp_path / "missing.gguf"))
    shutil.copy(files.target, tmp_path)
    assert gguf_source(str(tmp_path)) == (str(tmp_path), target.name)
    (tmp_path / "config.json").write_text("{}")
    assert gguf_source(str(tmp_path)) is None
    (tmp_path / "config.json").unlink()
    shutil.copy(files.draft, tmp_path)
    with pytest.raises(ValueError, match=r"2 GGUF files \(draft.gguf, target.gguf\) .* pass one file's path"):
        LLM(str(tmp_path))


def test_e_an_architecture_transformers_cannot_read_is_named(tmp_path) -> None:
    path = tmp_path / "madeup.gguf"
    writer = gguf.GGUFWriter(str(path), "madeup")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        ValueError, match=rf"GGUF architecture 'madeup' \({path}\); it reads .*\bllama\b.*qwen2"
    ):
        LLM(str(path))


@pytest.mark.parametrize("missing", ["gguf", "accelerate"])
def test_f_without_the_extra_the_error_names_it(files, hide_module, missing) -> None:
    hide_module(missing)
    with pytest.raises(
        ModuleNotFoundError, match=r"needs the gguf extra: pip install 'speculative\[gguf\]'"
    ) as caught:
        LLM(files.target)
    assert caught.value.name == missing


def test_tensor_parallelism_of_a_gguf_is_refused_by_name(files) -> None:
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=2 does not split a GGUF file"):
        load_model(
            files.draft,
            tensor_parallel=SimpleNamespace(size=2),
            tensor_parallel_name="draft_tensor_parallel_size",
        )
