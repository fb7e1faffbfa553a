"""The CM-DARE reproduction (Li, Walls, Guo, ICDCS 2020): the paper's tables (`tables`), features, regressors and
model selection, the parameter-server scaling law, and the paper's protocols (`reproduce`, `cocoweave perf cmdare`)."""
