"""Stage 2, extract: the aux layers and the last layer of the target over every sample,
from this process or a serving engine's dumps, into checksummed shards."""
