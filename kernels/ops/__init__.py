"""Op families: norm, rope, activation, attention. Import the submodules directly."""
