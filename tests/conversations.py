"""Conversations shared by the model and engine tests."""

from kvcore.conversation import Turn

MAYA = [
    Turn("Maya", "I moved to Porto in March for a job at the aquarium."),
    Turn("Assistant", "Congratulations! What will you work on?"),
    Turn("Maya", "Octopus behaviour. I also adopted a grey cat called Pixel."),
    Turn("Assistant", "Pixel is a great name."),
    Turn("Maya", "I am allergic to peanuts and I run half marathons."),
]
