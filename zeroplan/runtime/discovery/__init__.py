"""Learning the model and the recipe from the user's script instead of asking for them."""
