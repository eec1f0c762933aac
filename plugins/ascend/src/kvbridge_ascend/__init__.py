"""kvbridge device plugin for Huawei Ascend NPUs."""
