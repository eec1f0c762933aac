"""kvbridge device plugin for Cambricon MLUs."""
