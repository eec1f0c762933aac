"""kvbridge transport on NVIDIA NIXL."""
