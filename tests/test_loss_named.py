"""The loss measured is named: in each table's title (remat-kit's next-token cross-entropy,
or the user's own loss from (model, batch, loss)), in the first lines of --help, and in the
error for a model whose output is not logits."""

import pytest

from remat_kit.cli import commands as cli

OWN = '''
import jax, jax.numpy as jnp
from tests.zoo.gpt_linen import model as gpt

def my_loss(out, tokens):
    logp = jax.nn.log_softmax(out.logits[:, :-1])
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()

def with_loss():
    return gpt(), jnp.zeros((2, 16), jnp.int32), my_loss
'''


@pytest.mark.parametrize("function, loss", [
    ("tests.zoo.gpt_linen:model", "loss: remat-kit's mean next-token cross-entropy of the logits"),
    ("own.py:with_loss", "loss: your my_loss")])
def test_the_title_names_the_loss_measured(function, loss, capsys, tmp_path, monkeypatch):
    (tmp_path / "own.py").write_text(OWN)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "200")
    assert cli.main(["compare", "--model", function, "--batch", "2", "--seq", "16",
                     "--policies", "none,full"]) == 0
    title = next(line for line in capsys.readouterr().out.splitlines() if "seq 16" in line)
    assert title.endswith(f": batch 2, seq 16, float32, {loss} (XLA CPU compile)")


@pytest.mark.parametrize("argv", [[], ["compare"], ["fit"]])
def test_help_opens_with_your_model_and_its_loss(argv, capsys):
    try:
        cli.main([*argv, "--help"])
    except SystemExit:  # argparse's exit after the help
        pass
    head = capsys.readouterr().out.split("\n\n")[1]
    assert "--model FILE.py:FN" in head and "(model, batch, loss)" in head
    assert "remat-kit's mean next-token cross-entropy" in head


def test_a_model_that_shards_its_batch_is_initialised_at_the_batch(capsys):
    # Its shard_map splits the batch 4 ways: at batch 1 its init failed.
    assert cli.main(["compare", "--model", "tests/zoo/shard_map_linen.py:model", "--batch",
                     "8", "--seq", "16", "--policies", "none,full"]) == 0
    out = capsys.readouterr()
    assert "shard_map_linen.py:model: batch 8, seq 16" in out.out and "error" not in out.out


def test_a_batch_the_model_refuses_is_named_as_the_tool_gave_it(capsys):
    assert cli.main(["compare", "--model", "tests/zoo/shard_map_linen.py:model", "--batch",
                     "6", "--seq", "16", "--policies", "none"]) == 2
    err = capsys.readouterr().err
    assert "int32 tokens [6, 16]" in err and "--batch and --seq" in err
