"""Studies built on the experiment and the sweep tooling, one folder each."""
