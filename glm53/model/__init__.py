"""The GLM-5.3 forward: RoPE, norms, MLA over the latent cache, the DSA indexer, MoE, the stack."""
from glm53.model.parallel import RankPlan
from glm53.model.transformer import ForwardOutput, Glm53Model, ModelWeights

__all__ = ["ForwardOutput", "Glm53Model", "ModelWeights", "RankPlan"]
