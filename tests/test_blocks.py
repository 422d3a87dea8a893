"""The shared transformer block is torch's pre-LN encoder layer; the stack returns every layer."""

import pytest
import torch
import torch.nn as nn

from course_lib.core.blocks import Block, RegionEmbedding, Transformer


def _torch_layer_from(block: Block, hidden: int, heads: int) -> nn.TransformerEncoderLayer:
    """torch's layer holding the same weights as our block."""
    layer = nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True)
    with torch.no_grad():
        layer.self_attn.in_proj_weight.copy_(block.attn.qkv.weight)
        layer.self_attn.in_proj_bias.copy_(block.attn.qkv.bias)
        layer.self_attn.out_proj.weight.copy_(block.attn.out.weight)
        layer.self_attn.out_proj.bias.copy_(block.attn.out.bias)
        layer.linear1.load_state_dict(block.mlp[0].state_dict())
        layer.linear2.load_state_dict(block.mlp[3].state_dict())
        layer.norm1.load_state_dict(block.ln_1.state_dict())
        layer.norm2.load_state_dict(block.ln_2.state_dict())
    return layer


def test_block_equals_torch_pre_ln_layer_with_padding():
    torch.manual_seed(0)
    hidden, heads = 32, 4
    block = Block(hidden, heads).eval()
    reference = _torch_layer_from(block, hidden, heads).eval()
    x = torch.randn(3, 7, hidden)
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 2 + [0] * 5], dtype=torch.bool)
    ours = block(x, mask)
    theirs = reference(x, src_key_padding_mask=~mask)
    real = mask.unsqueeze(-1)
    torch.testing.assert_close(ours * real, theirs * real, atol=1e-5, rtol=1e-5)


def test_padding_changes_nothing_and_layers_are_returned():
    torch.manual_seed(1)
    stack = Transformer(16, layers=3, heads=2).eval()
    x = torch.randn(2, 5, 16)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    last, layers = stack(x, mask, return_layers=True)
    assert len(layers) == 3 and torch.equal(layers[-1], last)
    changed = x.clone()
    changed[0, 3:] = 100.0  # garbage in the padded slots
    torch.testing.assert_close(stack(changed, mask)[0, :3], last[0, :3])
    # layer l's state is the stack of the first l blocks
    two = Transformer(16, layers=2, heads=2).eval()
    two.blocks.load_state_dict(stack.blocks[:2].state_dict())
    two.ln_f.load_state_dict(stack.ln_f.state_dict())
    torch.testing.assert_close(two(x, mask), layers[1])


def test_region_embedding_shapes_and_bad_heads():
    emb = RegionEmbedding(region_dim=10, hidden=8)
    assert emb(torch.randn(2, 4, 10), torch.rand(2, 4, 7)).shape == (2, 4, 8)
    with pytest.raises(ValueError, match="multiple of heads"):
        Block(10, 3)
