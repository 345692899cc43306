"""turbotrain inside trainers it does not drive (Hugging Face, Lightning, Accelerate, Ray). Nothing
here is imported by ``import turbotrain``: each module imports its framework, an optional extra."""
