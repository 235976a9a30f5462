"""Every ```python block of README.md and docs/*.md runs.

The blocks of one file run in order in one namespace, in a temporary working directory, with
``examples/`` importable. A ``print(...)`` line may end in ``# <expected output>``: the printed
lines of a block must then equal those comments, in order. Shell commands are ```bash or
```text blocks, which are not run. A file may need inputs a reader would have (a checkpoint):
``_SETUP`` writes tiny stand-ins for them (and undoes a documented monkeypatch).
"""

import contextlib
import io
import json
import pathlib
import re
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_EXPECTED = re.compile(r"^\s*print\(.*\)\s+# (.*)$")


def python_blocks(path):
  """``(first line number, source)`` of every ```python block of ``path``."""
  text = path.read_text()
  return [(text[:m.start()].count("\n") + 2, m.group(1)) for m in _BLOCK.finditer(text)]


def _tiny_deepseek_checkpoint(directory):
  """``ckpt/``: a DeepSeek-V3-style config.json and the attention weights of 2 layers."""
  safetensors_numpy = pytest.importorskip("safetensors.numpy")
  ckpt = directory / "ckpt"
  ckpt.mkdir()
  dim, heads, q_lora, kv_lora, dn, dr, dv = 32, 4, 16, 12, 8, 8, 8
  config = {"hidden_size": dim, "num_attention_heads": heads, "q_lora_rank": q_lora,
            "kv_lora_rank": kv_lora, "qk_nope_head_dim": dn, "qk_rope_head_dim": dr, "v_head_dim": dv,
            "rope_theta": 10000.0, "max_position_embeddings": 4096, "num_hidden_layers": 2,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}
  (ckpt / "config.json").write_text(json.dumps(config))
  rng = np.random.default_rng(0)
  shapes = {"q_a_proj": (q_lora, dim), "q_a_layernorm": (q_lora,), "q_b_proj": (heads * (dn + dr), q_lora),
            "kv_a_proj_with_mqa": (kv_lora + dr, dim), "kv_a_layernorm": (kv_lora,),
            "kv_b_proj": (heads * (dn + dv), kv_lora), "o_proj": (dim, heads * dv)}
  tensors = {f"model.layers.{i}.self_attn.{name}.weight": (0.1 * rng.standard_normal(s)).astype(np.float32)
             for i in range(2) for name, s in shapes.items()}
  safetensors_numpy.save_file(tensors, str(ckpt / "model.safetensors"))


def _restore_hf_llama(monkeypatch):
  """your-model.md patches Hugging Face's Flax Llama module: undone after the test."""
  hf_llama = pytest.importorskip("transformers.models.llama.modeling_flax_llama")
  monkeypatch.setattr(hf_llama, "dot_product_attention_weights", hf_llama.dot_product_attention_weights)


def _your_model(monkeypatch):
  _restore_hf_llama(monkeypatch)
  hf_bloom = pytest.importorskip("transformers.models.bloom.modeling_flax_bloom")  # patched for ALiBi: undone after
  monkeypatch.setattr(hf_bloom, "dot_product_attention_weights", hf_bloom.dot_product_attention_weights)
  sys.path.insert(0, str(ROOT / "tests"))
  from _gemma_package import import_gemma
  import_gemma()  # the gemma package importable, kauldron stood in for where it is absent


_SETUP = {"deepseek.md": lambda tmp_path, monkeypatch: _tiny_deepseek_checkpoint(tmp_path),
          "your-model.md": lambda tmp_path, monkeypatch: _your_model(monkeypatch)}


def test_every_doc_file_is_collected():
  names = [p.name for p in FILES]
  assert "README.md" in names and "sharding.md" in names and len(names) > 5, names
  assert sum(len(python_blocks(p)) for p in FILES) >= 10
  for path in FILES:  # a block the regex would miss (indented fence, "```py") is not run: refuse it
    fences = re.findall(r"^\s*```(\S*)", path.read_text(), re.M)
    assert set(fences) <= {"", "python", "bash", "text"}, (path.name, set(fences))
    assert fences.count("python") == len(python_blocks(path)), path.name


def test_every_page_is_linked_from_the_readme_and_every_link_resolves():
  readme = (ROOT / "README.md").read_text()
  assert all(f"(docs/{p.name})" in readme for p in FILES[1:]), [p.name for p in FILES[1:]
                                                                if f"(docs/{p.name})" not in readme]
  for path in FILES:
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
      if not target.startswith(("http://", "https://")):
        assert (path.parent / target).exists(), f"{path.name}: broken link {target}"


@pytest.mark.parametrize("path", [p for p in FILES if python_blocks(p)], ids=lambda p: p.name)
def test_python_blocks_run(path, tmp_path, monkeypatch):
  blocks = python_blocks(path)
  monkeypatch.chdir(tmp_path)
  monkeypatch.syspath_prepend(str(ROOT / "examples"))
  if path.name in _SETUP:
    _SETUP[path.name](tmp_path, monkeypatch)
  scope = {"__name__": f"docs_{path.stem}"}
  for line, source in blocks:
    where = f"{path.relative_to(ROOT)}:{line}"
    expected = [m.group(1) for m in map(_EXPECTED.match, source.splitlines()) if m]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      try:
        exec(compile(source, where, "exec"), scope)
      except Exception as e:  # name the block in the failure
        raise AssertionError(f"the python block at {where} raised {type(e).__name__}: {e}") from e
    sys.stdout.write(out.getvalue())
    if expected:
      assert out.getvalue().splitlines() == expected, f"printed output of the block at {where}"
