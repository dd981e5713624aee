"""The decoding library below the stages that use it: the target and drafter caches (eager,
static, compiled), plain/chain/tree speculative decoding, and the batch decoders
regeneration runs on."""
