"""Modules: Module, Parameter, the layers and the GPT."""

from kiln.nn import functional
from kiln.nn.gpt import GPT, MLP, PRESETS, Block, CausalSelfAttention, GPTConfig, preset
from kiln.nn.layers import GELU, Dropout, Embedding, LayerNorm, Linear
from kiln.nn.module import Module, ModuleList, Parameter

__all__ = ["functional", "GPT", "PRESETS", "Block", "CausalSelfAttention", "GPTConfig", "MLP",
           "preset", "GELU", "Dropout", "Embedding", "LayerNorm", "Linear", "Module", "ModuleList",
           "Parameter"]
