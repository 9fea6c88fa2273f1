"""What lmbatch keeps on disk to skip work it has done: prepared workloads (`workloads`) and lm-eval's
loglikelihood scores (`scores`), each under a key of everything that decides it."""
