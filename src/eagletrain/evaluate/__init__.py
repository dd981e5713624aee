"""Stage 4b, eval: the exported drafter against the target, in this process or through a
server, with tau's confidence interval and the out-of-vocabulary share."""
