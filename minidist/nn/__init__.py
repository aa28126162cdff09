"""Layers and the GPT model, built on the tiny autograd.

Reading order: module.py (Module, Parameter), layers.py (Linear, Embedding, LayerNorm,
Dropout, MLP), attention.py (causal self-attention), routing.py and moe.py (mixture of experts),
gpt.py (the model). Parameters are filled by seed.init_parameters from (seed, name).
"""

from minidist.nn.attention import CausalSelfAttention
from minidist.nn.gpt import GPT, Block, GPTConfig
from minidist.nn.layers import MLP, Dropout, DropoutKey, Embedding, LayerNorm, Linear
from minidist.nn.module import Module, ModuleList, Parameter
from minidist.nn.moe import MoE
from minidist.nn.routing import Routing, RoutingRule, expert_capacity, route

__all__ = [
    "Module", "ModuleList", "Parameter", "Linear", "Embedding", "LayerNorm", "Dropout",
    "DropoutKey", "MLP", "CausalSelfAttention", "MoE", "Routing", "RoutingRule", "route",
    "expert_capacity",
    "GPT", "GPTConfig", "Block",
]
