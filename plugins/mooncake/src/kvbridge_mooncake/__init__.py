"""kvbridge transport on Mooncake's Transfer Engine."""
