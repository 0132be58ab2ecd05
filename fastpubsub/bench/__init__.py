"""Load generator: `fastpubsub bench` (see fastpubsub.bench.cli)."""
