"""Part IV, from a model to an assistant: instruction tuning (chapter 26), preferences (27) and
rewards (28), each loss proven equal to TRL's on the same inputs."""
