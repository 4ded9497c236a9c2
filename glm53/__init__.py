"""glm53 package."""
