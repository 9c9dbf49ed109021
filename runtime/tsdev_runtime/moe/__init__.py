"""Mixture of experts: the router, the stacked experts and the sparse MLP block (reloadable, like
tsdev_runtime.layers)."""
