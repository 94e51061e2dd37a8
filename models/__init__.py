"""Models of the seed papers, written as ordinary NumPyro code with privacy annotations."""
