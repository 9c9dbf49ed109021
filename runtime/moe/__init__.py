"""Mixture of experts: the router, the stacked experts and the sparse MLP block (reloadable, like runtime.layers)."""
