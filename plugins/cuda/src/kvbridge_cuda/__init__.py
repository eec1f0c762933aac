"""kvbridge device plugin for NVIDIA GPUs."""
